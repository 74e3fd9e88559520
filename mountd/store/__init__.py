"""The local SSD store: content by SHA-256 in diskcache."""
