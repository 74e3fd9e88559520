"""The substitutable view: the jobs behind a view's opens and the view's readahead."""
