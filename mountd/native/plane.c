/* The native data plane (plane.h): request threads, the tables they answer from, and
 * the queue of requests they hand to Python. Protocol structures are the kernel's own
 * (<linux/fuse.h>); nothing here calls into Python or libfuse. */
#define _GNU_SOURCE
#include "plane.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/fuse.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* A request: at most max_write (libfuse 3.14: 1 MiB) plus its headers. The kernel
 * refuses a read into less. */
#define REQUEST_BUF ((1 << 20) + (64 << 10))
#define DATA_BUF (1 << 20) /* a READ's reply: at most max_pages (256) pages */
#define SLOT_BLOCK 4096     /* slots are allocated in blocks that never move */
#define HIT_RING 65536
#define STOP_SIGNAL SIGUSR2 /* interrupts a thread's blocking read when stopping */
#define BLKSIZE (1 << 17)

/* FUSE passthrough (protocol 7.40, kernel 6.9), newer than <linux/fuse.h> here */
#define INIT_PASSTHROUGH (1u << (37 - 32)) /* FUSE_PASSTHROUGH, in flags2 */
#define FOPEN_PASSTHROUGH_ (1u << 7)
#define FH_NATIVE (1ULL << 63) /* a file handle the plane gave: its backing id below */
struct backing_map {
	int32_t fd;
	uint32_t flags;
	uint64_t padding;
};
#define BACKING_OPEN _IOW(229, 1, struct backing_map)
#define BACKING_CLOSE _IOW(229, 2, uint32_t)
struct open_out { /* fuse_open_out with its backing id */
	uint64_t fh;
	uint32_t open_flags;
	int32_t backing_id;
};

struct slot {
	uint8_t digest[PLANE_DIGEST];
	char name[PLANE_NAME];
	uint32_t refs;  /* dataset entries naming it */
	uint8_t served; /* stored, verified, and its name known */
	int32_t backing_id; /* passthrough: the value file's backing id, 0 if none */
	atomic_uint inflight; /* READs serving its file now, OPENs answering with it */
};

/* A backing id's opens (passthrough), and whose it is. The kernel refuses an inode
 * opened through two backing files at once, so an item keeps one id for as long as any
 * open uses it, even after its file is replaced (the same content: its digest's), and
 * none once none does (a backing file culled from the store would stay on disk). */
struct backing {
	uint32_t slot; /* slot + 1; 0: its slot was forgotten */
	uint32_t opens;
};

/* A digest's tree, shared by every dataset registered from that digest. */
struct tree {
	uint8_t identity[PLANE_DIGEST];
	uint32_t refs; /* datasets */
	uint32_t n_dirs, n_files;
	uint32_t *parents, *name_ends, *slots; /* slots[i]: entry i's slot */
	char *names;
	uint64_t *sizes;
	uint32_t *names_ht; /* (parent, name) -> node + 1, open addressing */
	uint64_t ht_mask;
};

struct dataset {
	uint64_t base;
	uint32_t uid, gid;
	int64_t time_ns;
	int suspended;
	struct tree *t;
};

struct request {
	struct request *next;
	size_t len;
	char data[];
};

struct plane {
	char *store_dir;
	size_t store_dir_len;
	int n_threads, started, dev_fd, event_fd;
	atomic_int passthrough;         /* OPEN answered with a backing file (else no-open READs) */
	atomic_int kernel_passthrough;  /* the kernel's INIT offered it */
	atomic_uint_fast64_t init_unique; /* the INIT request, whose reply is patched */
	double root_timeout, timeout;
	pthread_t *threads;
	atomic_int stopping;
	uint64_t hash_key[2];

	pthread_rwlock_t lock; /* the tables below */
	struct dataset **datasets; /* sorted by base */
	size_t n_datasets, cap_datasets;
	struct tree **trees;
	size_t n_trees, cap_trees;
	struct slot **blocks;
	size_t n_blocks;
	uint32_t n_slots;
	uint32_t *free_slots;
	size_t n_free, cap_free;
	uint32_t *items; /* digest -> slot + 1, open addressing */
	uint64_t items_mask, n_items;

	pthread_mutex_t queue_lock; /* the requests for Python, and whether reading ended */
	struct request *head, *tail;
	int ended;

	pthread_mutex_t backing_lock; /* slots' backing ids, and backings */
	struct backing *backings; /* by backing id */
	size_t n_backings;

	pthread_mutex_t hit_lock;
	struct plane_hit hits[HIT_RING];
	size_t hit_start, hit_count;

	atomic_uint_fast64_t lookups, getattrs, reads, read_bytes, served_files, forwarded,
		fallbacks, hits_dropped, forgets, opens, releases, backing_failures;
};

/* ---- SipHash-2-4: names and digests come from users' digests, so the tables'
 * hashes are keyed (a chosen set of colliding names would slow every user). ---- */
#define ROTL(x, b) (uint64_t)(((x) << (b)) | ((x) >> (64 - (b))))
#define SIPROUND                                                                    \
	do {                                                                        \
		v0 += v1; v1 = ROTL(v1, 13); v1 ^= v0; v0 = ROTL(v0, 32);           \
		v2 += v3; v3 = ROTL(v3, 16); v3 ^= v2;                              \
		v0 += v3; v3 = ROTL(v3, 21); v3 ^= v0;                              \
		v2 += v1; v1 = ROTL(v1, 17); v1 ^= v2; v2 = ROTL(v2, 32);           \
	} while (0)

static uint64_t siphash(const uint64_t key[2], uint64_t seed, const void *data, size_t len)
{
	const uint8_t *in = data;
	uint64_t v0 = 0x736f6d6570736575ULL ^ key[0], v1 = 0x646f72616e646f6dULL ^ key[1];
	uint64_t v2 = 0x6c7967656e657261ULL ^ key[0], v3 = 0x7465646279746573ULL ^ key[1];
	uint64_t m, b = ((uint64_t)len) << 56;
	v3 ^= seed; SIPROUND; SIPROUND; v0 ^= seed; /* the parent node, as a first word */
	size_t i;
	for (i = 0; i + 8 <= len; i += 8) {
		memcpy(&m, in + i, 8);
		v3 ^= m; SIPROUND; SIPROUND; v0 ^= m;
	}
	for (size_t j = 0; i + j < len; j++)
		b |= ((uint64_t)in[i + j]) << (8 * j);
	v3 ^= b; SIPROUND; SIPROUND; v0 ^= b;
	v2 ^= 0xff; SIPROUND; SIPROUND; SIPROUND; SIPROUND;
	return v0 ^ v1 ^ v2 ^ v3;
}

static uint64_t table_size(uint64_t n) /* a power of two at least twice n */
{
	uint64_t size = 16;
	while (size < 2 * n)
		size <<= 1;
	return size;
}

/* ---- slots and the digest table (under the write lock, or the read lock to look) ---- */
static struct slot *slot_at(const struct plane *p, uint32_t i)
{
	return &p->blocks[i / SLOT_BLOCK][i % SLOT_BLOCK];
}

static uint64_t item_hash(const struct plane *p, const uint8_t *digest)
{
	return siphash(p->hash_key, 0, digest, PLANE_DIGEST);
}

/* The table position holding digest, or of the empty place where it would go. */
static uint64_t item_pos(const struct plane *p, const uint8_t *digest)
{
	uint64_t pos = item_hash(p, digest) & p->items_mask;
	while (p->items[pos] &&
	       memcmp(slot_at(p, p->items[pos] - 1)->digest, digest, PLANE_DIGEST))
		pos = (pos + 1) & p->items_mask;
	return pos;
}

static struct slot *item_find(const struct plane *p, const uint8_t *digest)
{
	if (!p->items)
		return NULL;
	uint32_t entry = p->items[item_pos(p, digest)];
	return entry ? slot_at(p, entry - 1) : NULL;
}

static int items_resize(struct plane *p, uint64_t size)
{
	uint32_t *old = p->items;
	uint64_t old_size = old ? p->items_mask + 1 : 0;
	uint32_t *items = calloc(size, sizeof *items);
	if (!items)
		return -ENOMEM;
	p->items = items;
	p->items_mask = size - 1;
	for (uint64_t i = 0; i < old_size; i++)
		if (old[i])
			p->items[item_pos(p, slot_at(p, old[i] - 1)->digest)] = old[i];
	free(old);
	return 0;
}

/* The slot of digest, made if new; UINT32_MAX where memory ran out. */
static uint32_t item_ref(struct plane *p, const uint8_t *digest)
{
	if (!p->items || 2 * (p->n_items + 1) > p->items_mask + 1)
		if (items_resize(p, table_size(p->n_items + 1)))
			return UINT32_MAX;
	uint64_t pos = item_pos(p, digest);
	if (p->items[pos]) {
		slot_at(p, p->items[pos] - 1)->refs++;
		return p->items[pos] - 1;
	}
	uint32_t i;
	if (p->n_free) {
		i = p->free_slots[--p->n_free];
	} else {
		if (p->n_slots == p->n_blocks * SLOT_BLOCK) {
			struct slot **blocks = realloc(p->blocks, (p->n_blocks + 1) * sizeof *blocks);
			if (!blocks)
				return UINT32_MAX;
			p->blocks = blocks;
			if (!(blocks[p->n_blocks] = calloc(SLOT_BLOCK, sizeof(struct slot))))
				return UINT32_MAX;
			p->n_blocks++;
		}
		i = p->n_slots++;
	}
	struct slot *s = slot_at(p, i);
	memcpy(s->digest, digest, PLANE_DIGEST);
	s->refs = 1;
	s->served = 0;
	p->items[pos] = i + 1;
	p->n_items++;
	return i;
}

/* Under backing_lock: close slot s's backing id where no open uses it (else its last
 * RELEASE does). `forget`: the slot itself is going. */
static void backing_drop(struct plane *p, struct slot *s, int forget)
{
	int32_t id = s->backing_id;
	if (id <= 0)
		return;
	struct backing *b = &p->backings[id];
	if (b->opens == 0) {
		uint32_t closing = (uint32_t)id;
		ioctl(p->dev_fd, BACKING_CLOSE, &closing);
		b->slot = 0;
		s->backing_id = 0;
	} else if (forget) {
		b->slot = 0; /* its last RELEASE closes it */
		s->backing_id = 0;
	}
}

/* One reference to slot i fewer; a slot no entry names is forgotten (a READ still in
 * flight on it only counts itself off its inflight). */
static void item_unref(struct plane *p, uint32_t i)
{
	struct slot *s = slot_at(p, i);
	if (--s->refs)
		return;
	uint64_t pos = item_pos(p, s->digest), next = pos;
	p->items[pos] = 0; /* backward-shift deletion keeps every probe sequence whole */
	for (;;) {
		next = (next + 1) & p->items_mask;
		if (!p->items[next])
			break;
		uint64_t home = item_hash(p, slot_at(p, p->items[next] - 1)->digest) & p->items_mask;
		if (((next - home) & p->items_mask) >= ((next - pos) & p->items_mask)) {
			p->items[pos] = p->items[next];
			p->items[next] = 0;
			pos = next;
		}
	}
	p->n_items--;
	s->served = 0;
	pthread_mutex_lock(&p->backing_lock);
	backing_drop(p, s, 1);
	pthread_mutex_unlock(&p->backing_lock);
	if (p->n_free == p->cap_free) {
		size_t cap = p->cap_free ? 2 * p->cap_free : 1024;
		uint32_t *free_slots = realloc(p->free_slots, cap * sizeof *free_slots);
		if (!free_slots)
			return; /* the slot is lost to reuse, not to correctness */
		p->free_slots = free_slots;
		p->cap_free = cap;
	}
	p->free_slots[p->n_free++] = i;
}

/* ---- datasets ---- */
static size_t dataset_pos(const struct plane *p, uint64_t inode) /* first base > inode */
{
	size_t lo = 0, hi = p->n_datasets;
	while (lo < hi) {
		size_t mid = (lo + hi) / 2;
		if (p->datasets[mid]->base <= inode)
			lo = mid + 1;
		else
			hi = mid;
	}
	return lo;
}

static struct dataset *dataset_of(const struct plane *p, uint64_t inode, uint32_t *node)
{
	size_t pos = dataset_pos(p, inode);
	if (!pos)
		return NULL;
	struct dataset *ds = p->datasets[pos - 1];
	uint64_t local = inode - ds->base;
	if (local >= (uint64_t)ds->t->n_dirs + ds->t->n_files)
		return NULL;
	*node = (uint32_t)local;
	return ds;
}

static const char *node_name(const struct tree *t, uint32_t node, size_t *len)
{
	uint32_t start = node ? t->name_ends[node - 1] : 0;
	*len = t->name_ends[node] - start;
	return t->names + start;
}

static uint64_t name_hash(const struct plane *p, uint32_t parent, const char *name, size_t len)
{
	return siphash(p->hash_key, parent, name, len);
}

static uint32_t tree_lookup(const struct plane *p, const struct tree *t, uint32_t parent,
			    const char *name, size_t len)
{
	uint64_t pos = name_hash(p, parent, name, len) & t->ht_mask;
	for (uint32_t entry; (entry = t->names_ht[pos]); pos = (pos + 1) & t->ht_mask) {
		size_t found_len;
		const char *found = node_name(t, entry - 1, &found_len);
		if (t->parents[entry - 1] == parent && found_len == len &&
		    !memcmp(found, name, len))
			return entry - 1;
	}
	return 0; /* node 0 is no one's child */
}

static void tree_free(struct tree *t)
{
	if (!t)
		return;
	free(t->parents);
	free(t->name_ends);
	free(t->slots);
	free(t->names);
	free(t->sizes);
	free(t->names_ht);
	free(t);
}

static struct tree *tree_of(const struct plane *p, const uint8_t *identity)
{
	for (size_t i = 0; i < p->n_trees; i++)
		if (!memcmp(p->trees[i]->identity, identity, PLANE_DIGEST))
			return p->trees[i];
	return NULL;
}

/* ---- replies ---- */
static void reply(struct plane *p, uint64_t unique, int error, const void *arg, size_t len)
{
	struct fuse_out_header out = {
		.len = (uint32_t)(sizeof out + (error ? 0 : len)), .error = -error, .unique = unique};
	struct iovec iov[2] = {{&out, sizeof out}, {(void *)arg, len}};
	/* ENOENT: the request was interrupted meanwhile; nothing else is ours to mend */
	(void)!writev(p->dev_fd, iov, error || !len ? 1 : 2);
}

static uint64_t timeout_sec(double t) /* as libfuse's calc_timeout_sec */
{
	return t > (double)ULONG_MAX ? ULONG_MAX : t < 0.0 ? 0 : (uint64_t)t;
}

static uint32_t timeout_nsec(double t)
{
	double f = t - (double)timeout_sec(t);
	return f < 0.0 ? 0 : f >= 0.999999999 ? 999999999 : (uint32_t)(f * 1.0e9);
}

/* The attributes mountd's Python handlers give a dataset node (datasets_fs._node_attr). */
static double fill_attr(const struct plane *p, const struct dataset *ds, uint32_t node,
			struct fuse_attr *a)
{
	memset(a, 0, sizeof *a);
	a->ino = ds->base + node;
	a->uid = ds->uid;
	a->gid = ds->gid;
	int64_t sec = ds->time_ns / 1000000000, nsec = ds->time_ns % 1000000000;
	if (nsec < 0) {
		sec--;
		nsec += 1000000000;
	}
	a->atime = a->mtime = a->ctime = (uint64_t)sec;
	a->atimensec = a->mtimensec = a->ctimensec = (uint32_t)nsec;
	a->blksize = BLKSIZE;
	if (node < ds->t->n_dirs) {
		a->mode = S_IFDIR | (node == 0 ? 0700 : 0555);
		a->nlink = 2;
	} else {
		uint64_t size = ds->t->sizes[node - ds->t->n_dirs];
		a->mode = S_IFREG | 0444;
		a->nlink = 1;
		a->size = size;
		a->blocks = (size + 511) / 512;
	}
	return node == 0 ? p->root_timeout : p->timeout;
}

/* ---- requests answered here (1), or left to Python (0) ---- */
static int do_lookup(struct plane *p, const struct fuse_in_header *in, const char *name,
		     size_t len)
{
	if (!len || (len == 1 && name[0] == '.') || (len == 2 && !memcmp(name, "..", 2)))
		return 0;
	struct fuse_entry_out out;
	uint32_t node;
	int error = 0;
	pthread_rwlock_rdlock(&p->lock);
	struct dataset *ds = dataset_of(p, in->nodeid, &node);
	if (!ds || node >= ds->t->n_dirs) {
		pthread_rwlock_unlock(&p->lock);
		return 0;
	}
	uint32_t child = tree_lookup(p, ds->t, node, name, len);
	if (child) {
		memset(&out, 0, sizeof out);
		double timeout = fill_attr(p, ds, child, &out.attr);
		out.nodeid = ds->base + child;
		out.entry_valid = out.attr_valid = timeout_sec(timeout);
		out.entry_valid_nsec = out.attr_valid_nsec = timeout_nsec(timeout);
	} else {
		error = ENOENT;
	}
	pthread_rwlock_unlock(&p->lock);
	atomic_fetch_add_explicit(&p->lookups, 1, memory_order_relaxed);
	reply(p, in->unique, error, &out, sizeof out);
	return 1;
}

static int do_getattr(struct plane *p, const struct fuse_in_header *in)
{
	struct fuse_attr_out out;
	uint32_t node;
	pthread_rwlock_rdlock(&p->lock);
	struct dataset *ds = dataset_of(p, in->nodeid, &node);
	if (!ds) {
		pthread_rwlock_unlock(&p->lock);
		return 0;
	}
	memset(&out, 0, sizeof out);
	double timeout = fill_attr(p, ds, node, &out.attr);
	pthread_rwlock_unlock(&p->lock);
	out.attr_valid = timeout_sec(timeout);
	out.attr_valid_nsec = timeout_nsec(timeout);
	atomic_fetch_add_explicit(&p->getattrs, 1, memory_order_relaxed);
	reply(p, in->unique, 0, &out, sizeof out);
	return 1;
}

static uint64_t now_ns(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (uint64_t)t.tv_sec * 1000000000 + (uint64_t)t.tv_nsec;
}

/* A file served: its inode, and how long since `started` (now_ns) it took. */
static void record_hit(struct plane *p, uint64_t inode, uint64_t started)
{
	struct plane_hit hit = {.inode = inode, .ns = now_ns() - started};
	pthread_mutex_lock(&p->hit_lock);
	if (p->hit_count < HIT_RING) {
		p->hits[(p->hit_start + p->hit_count++) % HIT_RING] = hit;
	} else {
		atomic_fetch_add_explicit(&p->hits_dropped, 1, memory_order_relaxed);
	}
	pthread_mutex_unlock(&p->hit_lock);
}

/* STORE/ab/cd/<28 more>.val, as diskcache names its value files */
static void value_path(const struct plane *p, const char *name, char *path)
{
	char *at = mempcpy(path, p->store_dir, p->store_dir_len);
	*at++ = '/';
	at = mempcpy(at, name, 2);
	*at++ = '/';
	at = mempcpy(at, name + 2, 2);
	*at++ = '/';
	at = mempcpy(at, name + 4, PLANE_NAME - 4);
	memcpy(at, ".val", 5);
}

/* A thread's buffers: a request, a READ's bytes, and a pipe to splice them through. */
struct worker {
	char *buf, *data;
	int pipe[2]; /* -1: none (it could not be made, or broke): pread and writev */
};

static void pipe_close(struct worker *w)
{
	if (w->pipe[0] >= 0) {
		close(w->pipe[0]);
		close(w->pipe[1]);
	}
	w->pipe[0] = w->pipe[1] = -1;
}

static void pipe_open(struct worker *w)
{
	w->pipe[0] = w->pipe[1] = -1;
	if (pipe2(w->pipe, O_CLOEXEC)) {
		w->pipe[0] = w->pipe[1] = -1;
		return;
	}
	/* a whole reply in the pipe: its header and DATA_BUF bytes */
	if (fcntl(w->pipe[1], F_SETPIPE_SZ, DATA_BUF + 4096) < DATA_BUF + 4096)
		pipe_close(w);
}

/* The reply to READ `unique` put in the pipe: its header, and n bytes of fd from off
 * as references to the store file's pages (no copy through this process). 1 if put;
 * 0 where the file gave fewer bytes; -1 where the pipe failed (the caller copies
 * instead). The pipe is empty again where it was not put. */
static int splice_fill(struct worker *w, uint64_t unique, int fd, uint64_t off, uint64_t n)
{
	struct fuse_out_header out = {.len = (uint32_t)(sizeof out + n), .unique = unique};
	if (write(w->pipe[1], &out, sizeof out) != (ssize_t)sizeof out) {
		pipe_close(w);
		return -1;
	}
	loff_t at = (loff_t)off;
	for (uint64_t moved = 0; moved < n;) {
		ssize_t got = splice(fd, &at, w->pipe[1], NULL, n - moved, SPLICE_F_MOVE);
		if (got < 0 && errno == EINTR)
			continue;
		if (got <= 0) { /* shorter than its entry, or unreadable: the pipe holds a part */
			pipe_close(w);
			pipe_open(w);
			return got == 0 ? 0 : -1;
		}
		moved += (uint64_t)got;
	}
	return 1;
}

/* The reply splice_fill put in the pipe, to the kernel (which moves or copies its
 * pages into the FUSE file's). */
static void splice_send(struct plane *p, struct worker *w, uint64_t n)
{
	size_t len = sizeof(struct fuse_out_header) + n;
	if (splice(w->pipe[0], NULL, p->dev_fd, NULL, len, SPLICE_F_MOVE) != (ssize_t)len) {
		pipe_close(w); /* refused (interrupted): what is left in the pipe goes */
		pipe_open(w);
	}
}

/* The served item a READ or an OPEN of `inode` is for: its slot, counted in flight
 * (a withdrawal waits for the reply; the caller counts it off), with its index, its
 * entry's size and its value file's path. NULL where Python is to answer: not a file
 * of a registered dataset, a suspended dataset's, or an item not served. */
static struct slot *served_item(struct plane *p, uint64_t inode, uint32_t *index,
				uint64_t *size, char *path)
{
	uint32_t node;
	char name[PLANE_NAME];
	pthread_rwlock_rdlock(&p->lock);
	struct dataset *ds = dataset_of(p, inode, &node);
	struct slot *s = NULL;
	if (ds && !ds->suspended && node >= ds->t->n_dirs) {
		*index = ds->t->slots[node - ds->t->n_dirs];
		s = slot_at(p, *index);
		if (s->served) {
			atomic_fetch_add(&s->inflight, 1);
			*size = ds->t->sizes[node - ds->t->n_dirs];
			memcpy(name, s->name, PLANE_NAME);
		} else {
			s = NULL;
		}
	}
	pthread_rwlock_unlock(&p->lock);
	if (s)
		value_path(p, name, path);
	return s;
}

static int do_read(struct plane *p, const struct fuse_in_header *in,
		   const struct fuse_read_in *arg, struct worker *w)
{
	uint32_t si;
	uint64_t size, started = now_ns();
	char path[PATH_MAX];
	struct slot *s = served_item(p, in->nodeid, &si, &size, path);
	if (!s)
		return 0;

	uint64_t off = arg->offset, want = arg->size; /* at most max_pages: DATA_BUF */
	uint64_t n = off >= size ? 0 : size - off < want ? size - off : want;
	int fd = open(path, O_RDONLY | O_NOATIME | O_CLOEXEC);
	if (fd < 0)
		goto fallback; /* culled by another process, or unreadable: Python decides */
	struct stat st;
	if (fstat(fd, &st) || (uint64_t)st.st_size != size) {
		close(fd); /* not the entry's size: Python refuses it, and counts why */
		goto fallback;
	}
	int spliced = n && w->pipe[0] >= 0 ? splice_fill(w, in->unique, fd, off, n) : -1;
	if (spliced == 0) { /* shorter than its entry: not the verified file */
		close(fd);
		goto fallback;
	}
	for (uint64_t done = 0; spliced < 0 && done < n;) {
		ssize_t got = pread(fd, w->data + done, n - done, (off_t)(off + done));
		if (got < 0 && errno == EINTR)
			continue;
		if (got <= 0) {
			close(fd);
			goto fallback;
		}
		done += (uint64_t)got;
	}
	/* counted before the reply: a reader that asks for the counters next sees it */
	atomic_fetch_add_explicit(&p->reads, 1, memory_order_relaxed);
	atomic_fetch_add_explicit(&p->read_bytes, n, memory_order_relaxed);
	if (off == 0) {
		atomic_fetch_add_explicit(&p->served_files, 1, memory_order_relaxed);
		record_hit(p, in->nodeid, started);
	}
	if (spliced > 0)
		splice_send(p, w, n);
	else
		reply(p, in->unique, 0, w->data, n);
	atomic_fetch_sub(&s->inflight, 1);
	/* The kernel now holds these bytes in the FUSE inode's pages: the store file's
	 * copy would cache them twice. */
	if (off + n >= size)
		posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
	close(fd);
	return 1;
fallback:
	atomic_fetch_sub(&s->inflight, 1);
	atomic_fetch_add_explicit(&p->fallbacks, 1, memory_order_relaxed);
	return 0;
}

/* Passthrough: an OPEN of a served item is answered with a backing id for its value
 * file, and the kernel reads that file itself; no READ reaches mountd. */
static int32_t backing_use(struct plane *p, int32_t id)
{
	p->backings[id].opens++;
	return id;
}

/* Under backing_lock: the item's backing id to answer an OPEN with, if opens use one
 * now; else 0. */
static int32_t backing_of(struct plane *p, struct slot *s)
{
	int32_t id = s->backing_id;
	return id > 0 ? backing_use(p, id) : 0;
}

/* A new backing id for `path` if it is `size` bytes: the id, 0 where its size is not,
 * -1 where the kernel refused it (counted). */
static int32_t backing_open(struct plane *p, const char *path, uint64_t size)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return 0; /* culled by another process: Python decides */
	struct stat st;
	struct backing_map map = {.fd = fd};
	int sized = !fstat(fd, &st) && (uint64_t)st.st_size == size;
	int id = sized ? ioctl(p->dev_fd, BACKING_OPEN, &map) : 0;
	close(fd); /* the kernel holds the backing file now */
	if (sized && id <= 0) { /* EPERM without CAP_SYS_ADMIN, ... */
		atomic_fetch_add_explicit(&p->backing_failures, 1, memory_order_relaxed);
		return -1;
	}
	return id;
}

/* Under backing_lock: room for backing id `id`. */
static int backings_grow(struct plane *p, int32_t id)
{
	if ((size_t)id < p->n_backings)
		return 0;
	size_t n = p->n_backings ? p->n_backings : 1024;
	while (n <= (size_t)id)
		n *= 2;
	struct backing *b = realloc(p->backings, n * sizeof *b);
	if (!b)
		return -1;
	memset(b + p->n_backings, 0, (n - p->n_backings) * sizeof *b);
	p->backings = b;
	p->n_backings = n;
	return 0;
}

/* Passthrough: an OPEN of a served item is answered with a backing id for its value
 * file, and the kernel reads that file itself; no READ reaches mountd. */
static int do_open(struct plane *p, const struct fuse_in_header *in,
		   const struct fuse_open_in *arg)
{
	uint32_t si;
	uint64_t size, started = now_ns();
	char path[PATH_MAX];
	if ((arg->flags & O_ACCMODE) != O_RDONLY)
		return 0; /* Python refuses it (EROFS) */
	struct slot *s = served_item(p, in->nodeid, &si, &size, path);
	if (!s)
		return 0;

	pthread_mutex_lock(&p->backing_lock);
	int32_t id = backing_of(p, s);
	pthread_mutex_unlock(&p->backing_lock);
	if (!id) {
		int32_t made = backing_open(p, path, size);
		if (made <= 0) {
			if (!made)
				atomic_fetch_add_explicit(&p->fallbacks, 1, memory_order_relaxed);
			atomic_fetch_sub(&s->inflight, 1);
			return 0;
		}
		pthread_mutex_lock(&p->backing_lock);
		id = backing_of(p, s); /* another thread's, made meanwhile */
		if (!id && !backings_grow(p, made)) {
			s->backing_id = id = made;
			p->backings[made] = (struct backing){.slot = si + 1, .opens = 0};
			backing_use(p, made);
			made = 0;
		}
		pthread_mutex_unlock(&p->backing_lock);
		if (made) { /* not needed, or no memory to keep it */
			uint32_t closing = (uint32_t)made;
			ioctl(p->dev_fd, BACKING_CLOSE, &closing);
		}
		if (!id) {
			atomic_fetch_sub(&s->inflight, 1);
			return 0;
		}
	}
	struct open_out out = {
		.fh = FH_NATIVE | (uint32_t)id, .open_flags = FOPEN_PASSTHROUGH_, .backing_id = id};
	atomic_fetch_add_explicit(&p->opens, 1, memory_order_relaxed);
	atomic_fetch_add_explicit(&p->served_files, 1, memory_order_relaxed);
	record_hit(p, in->nodeid, started);
	reply(p, in->unique, 0, &out, sizeof out);
	atomic_fetch_sub(&s->inflight, 1);
	return 1;
}

static int do_release(struct plane *p, const struct fuse_in_header *in,
		      const struct fuse_release_in *arg)
{
	if (!(arg->fh & FH_NATIVE))
		return 0; /* a handle Python gave */
	uint32_t id = (uint32_t)arg->fh;
	pthread_mutex_lock(&p->backing_lock);
	if (id < p->n_backings && p->backings[id].opens) {
		struct backing *b = &p->backings[id];
		struct slot *s = b->slot ? slot_at(p, b->slot - 1) : NULL;
		if (!--b->opens) {
			if (s)
				backing_drop(p, s, 0);
			else
				ioctl(p->dev_fd, BACKING_CLOSE, &id); /* its slot was forgotten */
		}
	}
	pthread_mutex_unlock(&p->backing_lock);
	atomic_fetch_add_explicit(&p->releases, 1, memory_order_relaxed);
	reply(p, in->unique, 0, NULL, 0);
	return 1;
}

/* The INIT request: whether the kernel offers passthrough, and which reply to patch. */
static void saw_init(struct plane *p, const struct fuse_in_header *in, const char *arg,
		     size_t len)
{
	struct fuse_init_in init;
	memset(&init, 0, sizeof init);
	memcpy(&init, arg, len < sizeof init ? len : sizeof init);
	int offered = (init.flags & FUSE_INIT_EXT) && (init.flags2 & INIT_PASSTHROUGH);
	atomic_store(&p->kernel_passthrough, offered);
	atomic_store(&p->init_unique, in->unique);
}

/* ---- the queue of requests for Python ---- */
static void end_session(struct plane *p)
{
	pthread_mutex_lock(&p->queue_lock);
	if (!p->ended) {
		p->ended = 1;
		uint64_t one = 1; /* stays readable: every take says ENODEV from now on */
		(void)!write(p->event_fd, &one, sizeof one);
	}
	pthread_mutex_unlock(&p->queue_lock);
}

static void forward(struct plane *p, const char *buf, size_t len)
{
	struct request *r = malloc(sizeof *r + len);
	if (!r) {
		const struct fuse_in_header *in = (const void *)buf;
		if (in->opcode != FUSE_FORGET && in->opcode != FUSE_BATCH_FORGET &&
		    in->opcode != FUSE_INTERRUPT)
			reply(p, in->unique, ENOMEM, NULL, 0);
		return;
	}
	r->next = NULL;
	r->len = len;
	memcpy(r->data, buf, len);
	pthread_mutex_lock(&p->queue_lock);
	if (p->tail)
		p->tail->next = r;
	else
		p->head = r;
	p->tail = r;
	uint64_t one = 1;
	(void)!write(p->event_fd, &one, sizeof one);
	pthread_mutex_unlock(&p->queue_lock);
	atomic_fetch_add_explicit(&p->forwarded, 1, memory_order_relaxed);
}

ssize_t plane_take(struct plane *p, void *buf, size_t len)
{
	pthread_mutex_lock(&p->queue_lock);
	struct request *r = p->head;
	if (!r) {
		errno = p->ended ? ENODEV : EAGAIN;
		pthread_mutex_unlock(&p->queue_lock);
		return -1;
	}
	p->head = r->next;
	if (!p->head)
		p->tail = NULL;
	uint64_t value;
	(void)!read(p->event_fd, &value, sizeof value); /* one off the semaphore */
	pthread_mutex_unlock(&p->queue_lock);
	size_t n = r->len;
	if (n > len) { /* longer than libfuse reads (it never is): refused, not passed on */
		reply(p, ((const struct fuse_in_header *)r->data)->unique, EIO, NULL, 0);
		free(r);
		errno = EINTR; /* pyfuse3 waits for the next */
		return -1;
	}
	memcpy(buf, r->data, n);
	free(r);
	return (ssize_t)n;
}

ssize_t plane_write(struct plane *p, const struct iovec *iov, int count)
{
	/* libfuse 3.14 cannot ask for passthrough: its INIT reply is given the flag, and a
	 * stack depth of 1 (the store's file system is the only one below) */
	const struct fuse_out_header *out = iov[0].iov_base;
	if (count >= 2 && iov[0].iov_len >= sizeof *out && out->error == 0 &&
	    iov[1].iov_len >= sizeof(struct fuse_init_out) && atomic_load(&p->passthrough) &&
	    atomic_load(&p->kernel_passthrough) && out->unique == atomic_load(&p->init_unique)) {
		struct fuse_init_out *init = iov[1].iov_base;
		init->flags |= FUSE_INIT_EXT;
		init->flags2 |= INIT_PASSTHROUGH;
		init->unused[0] = 1; /* max_stack_depth */
		atomic_store(&p->init_unique, 0);
	}
	return writev(p->dev_fd, iov, count);
}

int plane_passthrough_offered(const struct plane *p)
{
	return atomic_load(&p->kernel_passthrough);
}

void plane_set_passthrough(struct plane *p, int on)
{
	atomic_store(&p->passthrough, on);
}

int plane_event_fd(const struct plane *p) { return p->event_fd; }
int plane_dev_fd(const struct plane *p) { return p->dev_fd; }

/* ---- threads ---- */
struct worker_args {
	struct plane *p;
};

static void on_stop_signal(int signum) { (void)signum; }

static void handle(struct plane *p, char *buf, size_t len, struct worker *w)
{
	const struct fuse_in_header *in = (const void *)buf;
	const char *arg = buf + sizeof *in;
	size_t arg_len = len - sizeof *in;
	switch (in->opcode) {
	case FUSE_INIT:
		saw_init(p, in, arg, arg_len);
		break;
	case FUSE_READ: /* with passthrough, only files Python opened are read here */
		if (!atomic_load(&p->passthrough) && arg_len >= sizeof(struct fuse_read_in) &&
		    ((const struct fuse_read_in *)arg)->size <= DATA_BUF &&
		    do_read(p, in, (const struct fuse_read_in *)arg, w))
			return;
		break;
	case FUSE_OPEN:
		if (atomic_load(&p->passthrough) && arg_len >= sizeof(struct fuse_open_in) &&
		    do_open(p, in, (const struct fuse_open_in *)arg))
			return;
		break;
	case FUSE_RELEASE:
		if (arg_len >= sizeof(struct fuse_release_in) &&
		    do_release(p, in, (const struct fuse_release_in *)arg))
			return;
		break;
	case FUSE_LOOKUP: {
		const char *end = memchr(arg, '\0', arg_len);
		if (end && do_lookup(p, in, arg, (size_t)(end - arg)))
			return;
		break;
	}
	case FUSE_GETATTR:
		if (do_getattr(p, in))
			return;
		break;
	case FUSE_FORGET:
	case FUSE_BATCH_FORGET:
		/* mountd keeps no lookup counts (a dataset's inodes live as long as it is
		 * mounted), and a FORGET has no reply */
		atomic_fetch_add_explicit(&p->forgets, 1, memory_order_relaxed);
		return;
	}
	forward(p, buf, len);
}

static void *worker_main(void *arg)
{
	struct plane *p = arg;
	sigset_t only_stop;
	sigemptyset(&only_stop);
	sigaddset(&only_stop, STOP_SIGNAL);
	pthread_sigmask(SIG_UNBLOCK, &only_stop, NULL);
	struct worker w = {.buf = malloc(REQUEST_BUF), .data = malloc(DATA_BUF)};
	pipe_open(&w);
	while (w.buf && w.data && !atomic_load(&p->stopping)) {
		ssize_t n = read(p->dev_fd, w.buf, REQUEST_BUF);
		if (n < 0) {
			if (errno == EINTR || errno == ENOENT || errno == EAGAIN)
				continue; /* stopping is checked above; ENOENT: interrupted */
			end_session(p); /* ENODEV: unmounted, or the connection aborted */
			break;
		}
		if ((size_t)n >= sizeof(struct fuse_in_header))
			handle(p, w.buf, (size_t)n, &w);
	}
	pipe_close(&w);
	free(w.buf);
	free(w.data);
	return NULL;
}

/* ---- the plane ---- */
struct plane *plane_new(const char *store_dir, int threads, double root_timeout,
			double timeout)
{
	size_t len = strlen(store_dir);
	if (threads < 1 || len + 8 + PLANE_NAME + 8 > PATH_MAX) {
		errno = EINVAL;
		return NULL;
	}
	struct plane *p = calloc(1, sizeof *p);
	if (!p)
		return NULL;
	p->store_dir = strdup(store_dir);
	p->store_dir_len = len;
	p->n_threads = threads;
	p->root_timeout = root_timeout;
	p->timeout = timeout;
	p->dev_fd = -1;
	p->event_fd = eventfd(0, EFD_SEMAPHORE | EFD_NONBLOCK | EFD_CLOEXEC);
	p->threads = calloc((size_t)threads, sizeof *p->threads);
	if (!p->store_dir || p->event_fd < 0 || !p->threads ||
	    getrandom(p->hash_key, sizeof p->hash_key, 0) != sizeof p->hash_key) {
		int e = errno ? errno : ENOMEM;
		if (p->event_fd >= 0)
			close(p->event_fd);
		free(p->threads);
		free(p->store_dir);
		free(p);
		errno = e;
		return NULL;
	}
	pthread_rwlock_init(&p->lock, NULL);
	pthread_mutex_init(&p->queue_lock, NULL);
	pthread_mutex_init(&p->hit_lock, NULL);
	pthread_mutex_init(&p->backing_lock, NULL);
	return p;
}

int plane_start(struct plane *p, int dev_fd)
{
	if (p->started)
		return -EBUSY;
	int flags = fcntl(dev_fd, F_GETFL);
	if (flags < 0 || fcntl(dev_fd, F_SETFL, flags & ~O_NONBLOCK) < 0)
		return -errno; /* a thread waits in read(2), never spins */
	struct sigaction sa;
	memset(&sa, 0, sizeof sa);
	sa.sa_handler = on_stop_signal; /* no SA_RESTART: the read returns EINTR */
	sigemptyset(&sa.sa_mask);
	if (sigaction(STOP_SIGNAL, &sa, NULL) < 0)
		return -errno;
	p->dev_fd = dev_fd;
	/* The threads start with every signal blocked (and unblock STOP_SIGNAL): the
	 * process's signals stay the main thread's. */
	sigset_t all, old;
	sigfillset(&all);
	pthread_sigmask(SIG_SETMASK, &all, &old);
	int error = 0, n;
	for (n = 0; n < p->n_threads; n++)
		if ((error = pthread_create(&p->threads[n], NULL, worker_main, p)))
			break;
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	p->started = n;
	if (error) {
		plane_stop(p);
		return -error;
	}
	return 0;
}

void plane_stop(struct plane *p)
{
	atomic_store(&p->stopping, 1);
	for (int i = 0; i < p->started; i++) {
		/* A signal just before the thread blocks in read(2) is lost: send it again
		 * until the thread has ended. */
		for (;;) {
			pthread_kill(p->threads[i], STOP_SIGNAL);
			struct timespec until;
			clock_gettime(CLOCK_REALTIME, &until);
			until.tv_nsec += 10 * 1000 * 1000;
			if (until.tv_nsec >= 1000000000) {
				until.tv_sec++;
				until.tv_nsec -= 1000000000;
			}
			if (!pthread_timedjoin_np(p->threads[i], NULL, &until))
				break;
		}
	}
	p->started = 0;
}

void plane_free(struct plane *p)
{
	if (!p)
		return;
	plane_stop(p);
	for (size_t i = 0; i < p->n_datasets; i++)
		free(p->datasets[i]);
	free(p->datasets);
	for (size_t i = 0; i < p->n_trees; i++)
		tree_free(p->trees[i]);
	free(p->trees);
	for (size_t i = 0; i < p->n_blocks; i++)
		free(p->blocks[i]);
	free(p->blocks);
	free(p->free_slots);
	free(p->items);
	for (struct request *r = p->head, *next; r; r = next) {
		next = r->next;
		free(r);
	}
	close(p->event_fd);
	pthread_rwlock_destroy(&p->lock);
	pthread_mutex_destroy(&p->queue_lock);
	pthread_mutex_destroy(&p->hit_lock);
	pthread_mutex_destroy(&p->backing_lock);
	free(p->backings);
	free(p->threads);
	free(p->store_dir);
	free(p);
}

/* A tree's entries' slots are taken and given back in batches, so that readers wait
 * for one batch at most. */
#define REF_BATCH 4096

static void tree_unref_slots(struct plane *p, struct tree *t, uint32_t n)
{
	for (uint32_t done = 0; done < n;) {
		pthread_rwlock_wrlock(&p->lock);
		for (uint32_t end = done + REF_BATCH < n ? done + REF_BATCH : n; done < end; done++)
			item_unref(p, t->slots[done]);
		pthread_rwlock_unlock(&p->lock);
	}
}

/* A new tree, built outside the lock and its slots taken; NULL with *error set. */
static struct tree *tree_new(struct plane *p, const uint8_t *identity,
			     const struct plane_tree *in, int *error)
{
	uint32_t n_dirs = in->n_dirs, n_files = in->n_files;
	uint64_t n_nodes = (uint64_t)n_dirs + n_files;
	*error = -EINVAL;
	if (!n_dirs || n_nodes > UINT32_MAX - 1 || in->name_ends[0] != 0)
		return NULL;
	for (uint64_t node = 1; node < n_nodes; node++) {
		if (in->name_ends[node] <= in->name_ends[node - 1] || in->parents[node] >= n_dirs)
			return NULL; /* every node but the root named, in a directory */
	}
	*error = -ENOMEM;
	struct tree *t = calloc(1, sizeof *t);
	if (!t)
		return NULL;
	size_t names_len = in->name_ends[n_nodes - 1];
	memcpy(t->identity, identity, PLANE_DIGEST);
	t->n_dirs = n_dirs;
	t->n_files = n_files;
	t->parents = malloc(n_nodes * sizeof *t->parents);
	t->name_ends = malloc(n_nodes * sizeof *t->name_ends);
	t->names = malloc(names_len + 1);
	t->sizes = malloc((n_files + 1) * sizeof *t->sizes);
	t->slots = malloc((n_files + 1) * sizeof *t->slots);
	uint64_t ht_size = table_size(n_nodes);
	t->names_ht = calloc(ht_size, sizeof *t->names_ht);
	t->ht_mask = ht_size - 1;
	if (!t->parents || !t->name_ends || !t->names || !t->sizes || !t->slots ||
	    !t->names_ht) {
		tree_free(t);
		return NULL;
	}
	memcpy(t->parents, in->parents, n_nodes * sizeof *t->parents);
	memcpy(t->name_ends, in->name_ends, n_nodes * sizeof *t->name_ends);
	memcpy(t->names, in->names, names_len);
	memcpy(t->sizes, in->sizes, n_files * sizeof *t->sizes);
	for (uint32_t node = 1; node < n_nodes; node++) {
		size_t len;
		const char *name = node_name(t, node, &len);
		if (tree_lookup(p, t, t->parents[node], name, len)) {
			tree_free(t); /* two entries of one name in a directory */
			*error = -EINVAL;
			return NULL;
		}
		uint64_t pos = name_hash(p, t->parents[node], name, len) & t->ht_mask;
		while (t->names_ht[pos])
			pos = (pos + 1) & t->ht_mask;
		t->names_ht[pos] = node + 1;
	}
	uint32_t done = 0;
	int full = 0;
	while (done < n_files && !full) {
		pthread_rwlock_wrlock(&p->lock);
		for (uint32_t end = done + REF_BATCH < n_files ? done + REF_BATCH : n_files;
		     done < end && !full; done++) {
			t->slots[done] = item_ref(p, in->digests + (size_t)done * PLANE_DIGEST);
			full = t->slots[done] == UINT32_MAX;
		}
		pthread_rwlock_unlock(&p->lock);
	}
	if (full) { /* out of memory: the slots taken go back */
		tree_unref_slots(p, t, done - 1);
		tree_free(t);
		return NULL;
	}
	*error = 0;
	return t;
}

int plane_has_tree(struct plane *p, const uint8_t *identity)
{
	pthread_rwlock_rdlock(&p->lock);
	int found = tree_of(p, identity) != NULL;
	pthread_rwlock_unlock(&p->lock);
	return found;
}

/* Under the write lock: room for one more in an array of pointers. */
static int room(void ***items, size_t n, size_t *cap)
{
	if (n < *cap)
		return 0;
	size_t more = *cap ? 2 * *cap : 16;
	void **grown = realloc(*items, more * sizeof *grown);
	if (!grown)
		return -ENOMEM;
	*items = grown;
	*cap = more;
	return 0;
}

int plane_add_dataset(struct plane *p, uint64_t base, const uint8_t *identity, uint32_t uid,
		      uint32_t gid, int64_t time_ns, const struct plane_tree *tree)
{
	struct dataset *ds = calloc(1, sizeof *ds);
	if (!ds)
		return -ENOMEM;
	ds->base = base;
	ds->uid = uid;
	ds->gid = gid;
	ds->time_ns = time_ns;
	struct tree *made = NULL;
	int error = 0;
	pthread_rwlock_rdlock(&p->lock);
	int shared = tree_of(p, identity) != NULL;
	pthread_rwlock_unlock(&p->lock);
	if (!shared) { /* the caller adds and removes datasets one at a time */
		if (!tree)
			error = -ENOENT;
		else
			made = tree_new(p, identity, tree, &error);
	}
	pthread_rwlock_wrlock(&p->lock);
	struct tree *t = error ? NULL : made ? made : tree_of(p, identity);
	if (!error && !t)
		error = -ENOENT;
	if (!error && base > UINT64_MAX - ((uint64_t)t->n_dirs + t->n_files))
		error = -EINVAL;
	size_t pos = dataset_pos(p, base);
	if (!error) {
		uint64_t end = base + t->n_dirs + t->n_files;
		const struct dataset *before = pos ? p->datasets[pos - 1] : NULL;
		if ((before && before->base + before->t->n_dirs + before->t->n_files > base) ||
		    (pos < p->n_datasets && p->datasets[pos]->base < end))
			error = -EEXIST;
	}
	if (!error)
		error = room((void ***)&p->datasets, p->n_datasets, &p->cap_datasets);
	if (!error && made)
		error = room((void ***)&p->trees, p->n_trees, &p->cap_trees);
	if (!error) {
		if (made)
			p->trees[p->n_trees++] = made;
		ds->t = t;
		t->refs++;
		memmove(p->datasets + pos + 1, p->datasets + pos,
			(p->n_datasets - pos) * sizeof *p->datasets);
		p->datasets[pos] = ds;
		p->n_datasets++;
	}
	pthread_rwlock_unlock(&p->lock);
	if (error) {
		if (made) {
			tree_unref_slots(p, made, made->n_files);
			tree_free(made);
		}
		free(ds);
	}
	return error;
}

int plane_remove_dataset(struct plane *p, uint64_t base)
{
	pthread_rwlock_wrlock(&p->lock);
	size_t pos = dataset_pos(p, base);
	if (!pos || p->datasets[pos - 1]->base != base) {
		pthread_rwlock_unlock(&p->lock);
		return -ENOENT;
	}
	struct dataset *ds = p->datasets[pos - 1];
	memmove(p->datasets + pos - 1, p->datasets + pos,
		(p->n_datasets - pos) * sizeof *p->datasets);
	p->n_datasets--;
	struct tree *t = ds->t;
	if (--t->refs) {
		t = NULL; /* other datasets share it */
	} else {
		for (size_t i = 0; i < p->n_trees; i++)
			if (p->trees[i] == t) {
				p->trees[i] = p->trees[--p->n_trees];
				break;
			}
	}
	pthread_rwlock_unlock(&p->lock);
	if (t) {
		tree_unref_slots(p, t, t->n_files);
		tree_free(t);
	}
	free(ds);
	return 0;
}

int plane_suspend_dataset(struct plane *p, uint64_t base, int suspended)
{
	pthread_rwlock_wrlock(&p->lock);
	size_t pos = dataset_pos(p, base);
	int found = pos && p->datasets[pos - 1]->base == base;
	if (found)
		p->datasets[pos - 1]->suspended = suspended;
	pthread_rwlock_unlock(&p->lock);
	return found ? 0 : -ENOENT;
}

int plane_serve(struct plane *p, const uint8_t *digest, const char *name)
{
	for (int i = 0; i < PLANE_NAME; i++)
		if (!strchr("0123456789abcdef", name[i]) || !name[i])
			return -EINVAL;
	pthread_rwlock_wrlock(&p->lock);
	struct slot *s = item_find(p, digest);
	if (s) {
		if (memcmp(s->name, name, PLANE_NAME)) { /* another file: new opens use it */
			pthread_mutex_lock(&p->backing_lock);
			backing_drop(p, s, 0);
			pthread_mutex_unlock(&p->backing_lock);
		}
		memcpy(s->name, name, PLANE_NAME);
		s->served = 1;
	}
	pthread_rwlock_unlock(&p->lock);
	return s != NULL;
}

size_t plane_withdraw(struct plane *p, const uint8_t *digest, int wait, uint64_t *inodes,
		      size_t max)
{
	size_t count = 0;
	pthread_rwlock_wrlock(&p->lock);
	uint64_t pos = p->items ? item_pos(p, digest) : 0;
	uint32_t entry = p->items ? p->items[pos] : 0;
	struct slot *s = entry ? slot_at(p, entry - 1) : NULL;
	if (s) {
		s->served = 0;
		pthread_mutex_lock(&p->backing_lock);
		backing_drop(p, s, 0);
		pthread_mutex_unlock(&p->backing_lock);
		for (size_t d = 0; d < p->n_datasets; d++) {
			const struct dataset *ds = p->datasets[d];
			for (uint32_t i = 0; i < ds->t->n_files; i++)
				if (ds->t->slots[i] == entry - 1) {
					if (count < max)
						inodes[count] = ds->base + ds->t->n_dirs + i;
					count++;
				}
		}
	}
	pthread_rwlock_unlock(&p->lock);
	/* READs that found it served before are counted in inflight; none starts now. */
	while (wait && s && atomic_load(&s->inflight)) {
		struct timespec pause = {0, 50 * 1000};
		nanosleep(&pause, NULL);
	}
	return count;
}

size_t plane_drain_hits(struct plane *p, struct plane_hit *hits, size_t max)
{
	pthread_mutex_lock(&p->hit_lock);
	size_t n = p->hit_count < max ? p->hit_count : max;
	for (size_t i = 0; i < n; i++)
		hits[i] = p->hits[(p->hit_start + i) % HIT_RING];
	p->hit_start = (p->hit_start + n) % HIT_RING;
	p->hit_count -= n;
	pthread_mutex_unlock(&p->hit_lock);
	return n;
}

void plane_counters(struct plane *p, struct plane_counters *out)
{
	out->lookups = atomic_load(&p->lookups);
	out->getattrs = atomic_load(&p->getattrs);
	out->reads = atomic_load(&p->reads);
	out->read_bytes = atomic_load(&p->read_bytes);
	out->hits = atomic_load(&p->served_files);
	out->forwarded = atomic_load(&p->forwarded);
	out->fallbacks = atomic_load(&p->fallbacks);
	out->hits_dropped = atomic_load(&p->hits_dropped);
	out->forgets = atomic_load(&p->forgets);
	out->opens = atomic_load(&p->opens);
	out->releases = atomic_load(&p->releases);
	out->backing_failures = atomic_load(&p->backing_failures);
}
