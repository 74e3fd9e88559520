/* The native data plane (plane.h): its threads, the requests they answer (LOOKUP,
 * GETATTR, READ and FORGET; OPEN and RELEASE in passthrough.c), the queue of the rest
 * for Python, the hits and counters. Its tables are tables.c's. */
#define _GNU_SOURCE
#include "plane_internal.h"

#include <sys/syscall.h>

/* ---- replies ---- */
void reply_on(int dev_fd, uint64_t unique, int error, const void *arg, size_t len)
{
	struct fuse_out_header out = {
		.len = (uint32_t)(sizeof out + (error ? 0 : len)), .error = -error, .unique = unique};
	struct iovec iov[2] = {{&out, sizeof out}, {(void *)arg, len}};
	/* ENOENT: the request was interrupted meanwhile; nothing else is ours to mend */
	(void)!writev(dev_fd, iov, error || !len ? 1 : 2);
}

void reply(struct plane *p, uint64_t unique, int error, const void *arg, size_t len)
{
	reply_on(p->dev_fd, unique, error, arg, len);
}

uint64_t timeout_sec(double t) /* as libfuse's calc_timeout_sec */
{
	return t > (double)ULONG_MAX ? ULONG_MAX : t < 0.0 ? 0 : (uint64_t)t;
}

uint32_t timeout_nsec(double t)
{
	double f = t - (double)timeout_sec(t);
	return f < 0.0 ? 0 : f >= 0.999999999 ? 999999999 : (uint32_t)(f * 1.0e9);
}

/* The attributes mountd's Python handlers give a dataset node (datasets_fs._node_attr). */
double fill_attr(const struct plane *p, const struct dataset *ds, uint32_t node,
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
	if (!ds || ds->pools || node >= ds->t->n_dirs) { /* a view's is its link: Python's */
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
	if (!ds || ds->pools) {
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

uint64_t now_ns(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (uint64_t)t.tv_sec * 1000000000 + (uint64_t)t.tv_nsec;
}

/* A file served: its inode, and how long since `started` (now_ns) it took. */
void record_hit(struct plane *p, uint64_t inode, uint64_t started)
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
void value_path(const struct plane *p, const char *name, char *path)
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
	w->page = (uint64_t)sysconf(_SC_PAGESIZE);
	if (pipe2(w->pipe, O_CLOEXEC)) {
		w->pipe[0] = w->pipe[1] = -1;
		return;
	}
	/* a whole reply in the pipe: its header and DATA_BUF bytes; a pipe above
	 * fs.pipe-max-size (1 MiB by default) needs CAP_SYS_RESOURCE, which a root in a
	 * container may lack: then the largest READs are copied (splice_fits) */
	int size = fcntl(w->pipe[1], F_SETPIPE_SZ, DATA_BUF + (int)w->page);
	if (size < 0)
		size = fcntl(w->pipe[1], F_SETPIPE_SZ, DATA_BUF);
	if (size < 0 || (uint64_t)size < 4 * w->page)
		pipe_close(w);
	else
		w->pipe_pages = (uint64_t)size / w->page;
}

/* Whether the reply to a READ of n bytes at off fits in the thread's pipe: its header
 * takes a buffer, and every page the bytes touch one more (a full pipe would block
 * the only thread that empties it). */
static int splice_fits(const struct worker *w, uint64_t off, uint64_t n)
{
	return w->pipe[0] >= 0 && n &&
	       1 + (off + n - 1) / w->page - off / w->page + 1 <= w->pipe_pages;
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
static void splice_send(struct worker *w, int dev_fd, uint64_t n)
{
	size_t len = sizeof(struct fuse_out_header) + n;
	if (splice(w->pipe[0], NULL, dev_fd, NULL, len, SPLICE_F_MOVE) != (ssize_t)len) {
		pipe_close(w); /* refused (interrupted): what is left in the pipe goes */
		pipe_open(w);
	}
}

/* The reply to READ `unique`, n bytes of fd from off, made ready: 1 in the thread's
 * pipe, -1 copied into its data buffer (no pipe, or it failed), 0 where the file gave
 * fewer bytes (nothing is ready). */
int file_fill(struct worker *w, uint64_t unique, int fd, uint64_t off, uint64_t n)
{
	int spliced = splice_fits(w, off, n) ? splice_fill(w, unique, fd, off, n) : -1;
	if (spliced == 0)
		return 0;
	for (uint64_t done = 0; spliced < 0 && done < n;) {
		ssize_t got = pread(fd, w->data + done, n - done, (off_t)(off + done));
		if (got < 0 && errno == EINTR)
			continue;
		if (got <= 0)
			return 0;
		done += (uint64_t)got;
	}
	return spliced;
}

/* The reply file_fill made ready, to the kernel on dev_fd. */
void file_send(struct plane *p, struct worker *w, int dev_fd, uint64_t unique, uint64_t n,
	       int filled)
{
	if (filled > 0) {
		splice_send(w, dev_fd, n);
	} else {
		atomic_fetch_add_explicit(&p->copied, 1, memory_order_relaxed);
		reply_on(dev_fd, unique, 0, w->data, n);
	}
}

/* cachestat(2) (Linux 6.5; Debian 12's headers predate it): one number on every
 * architecture */
#ifndef SYS_cachestat
#define SYS_cachestat 451
#endif
struct cache_range {
	uint64_t off, len;
};
struct cache_stat {
	uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted;
};
static atomic_int no_cachestat;

/* Whether the page cache holds none of fd's bytes [off, off + len); 1 where the kernel
 * cannot tell. */
static int none_cached(int fd, uint64_t off, uint64_t len)
{
	if (atomic_load_explicit(&no_cachestat, memory_order_relaxed))
		return 1;
	struct cache_range at = {off, len};
	struct cache_stat st;
	if (syscall(SYS_cachestat, fd, &at, &st, 0) == 0)
		return st.nr_cache == 0;
	if (errno == ENOSYS)
		atomic_store_explicit(&no_cachestat, 1, memory_order_relaxed);
	return 1;
}

/* The served item a READ or an OPEN of `inode` is for: its slot, counted in flight
 * (a withdrawal waits for the reply; the caller counts it off), with its index, its
 * entry's size and its value file's path. NULL where Python is to answer: not a file
 * of a registered dataset, a suspended dataset's, or an item not served. */
struct slot *served_item(struct plane *p, uint64_t inode, uint32_t *index,
				uint64_t *size, char *path)
{
	uint32_t node;
	char name[PLANE_NAME];
	pthread_rwlock_rdlock(&p->lock);
	struct dataset *ds = dataset_of(p, inode, &node);
	struct slot *s = NULL;
	if (ds && !ds->pools && !ds->suspended && node >= ds->t->n_dirs) {
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
	/* The store file's pages a READ brought in go once its reply is sent (the FUSE
	 * inode's pages hold those bytes), but only those: pages cached before it (written
	 * by a put, kept by the scrubber, read for another mount) are someone else's, and
	 * dropping them costs a read. Decided per READ: a file's READs may run at once, on
	 * other workers and for other mounts of the same item. */
	int fresh = n > 0 && none_cached(fd, off, n);
	int filled = file_fill(w, in->unique, fd, off, n);
	if (filled == 0) { /* shorter than its entry: not the verified file */
		close(fd);
		goto fallback;
	}
	/* counted before the reply: a reader that asks for the counters next sees it */
	atomic_fetch_add_explicit(&p->reads, 1, memory_order_relaxed);
	atomic_fetch_add_explicit(&p->read_bytes, n, memory_order_relaxed);
	if (off == 0) {
		atomic_fetch_add_explicit(&p->served_files, 1, memory_order_relaxed);
		record_hit(p, in->nodeid, started);
	}
	file_send(p, w, p->dev_fd, in->unique, n, filled);
	atomic_fetch_sub(&s->inflight, 1);
	/* to the end where it ends the file: the kernel keeps a range's partial last page */
	int last = off + n >= size;
	if (fresh && posix_fadvise(fd, (off_t)off, last ? 0 : (off_t)n, POSIX_FADV_DONTNEED) == 0 &&
	    last)
		atomic_fetch_add_explicit(&p->store_drops, 1, memory_order_relaxed);
	close(fd);
	return 1;
fallback:
	atomic_fetch_sub(&s->inflight, 1);
	atomic_fetch_add_explicit(&p->fallbacks, 1, memory_order_relaxed);
	return 0;
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

int plane_event_fd(const struct plane *p) { return p->event_fd; }
int plane_dev_fd(const struct plane *p) { return p->dev_fd; }

static void on_stop_signal(int signum) { (void)signum; }

/* STOP_SIGNAL's handler, which does nothing: installed without SA_RESTART, so that a
 * thread's read(2) returns EINTR. 0, or -1 with errno set. */
int stop_signal_ready(void)
{
	struct sigaction sa;
	memset(&sa, 0, sizeof sa);
	sa.sa_handler = on_stop_signal;
	sigemptyset(&sa.sa_mask);
	return sigaction(STOP_SIGNAL, &sa, NULL);
}

/* Start n threads running main(arg), with every signal blocked but STOP_SIGNAL (the
 * process's signals stay the main thread's); their number. */
int start_threads(pthread_t *threads, int n, void *(*main)(void *), void *arg)
{
	sigset_t all, old;
	sigfillset(&all);
	pthread_sigmask(SIG_SETMASK, &all, &old);
	int made;
	for (made = 0; made < n; made++)
		if (pthread_create(&threads[made], NULL, main, arg))
			break;
		else /* named for top -H and /proc: where mountd's CPU goes */
			pthread_setname_np(threads[made], "quiver-plane");
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	return made;
}

/* Join n threads, whose stopping flag is set: each is sent STOP_SIGNAL until it has
 * ended (one sent just before it blocks in read(2) is lost). */
void join_threads(pthread_t *threads, int n)
{
	for (int i = 0; i < n; i++) {
		for (;;) {
			pthread_kill(threads[i], STOP_SIGNAL);
			struct timespec until;
			clock_gettime(CLOCK_REALTIME, &until);
			until.tv_nsec += 10 * 1000 * 1000;
			if (until.tv_nsec >= 1000000000) {
				until.tv_sec++;
				until.tv_nsec -= 1000000000;
			}
			if (!pthread_timedjoin_np(threads[i], NULL, &until))
				break;
		}
	}
}

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

/* A thread of the plane's: STOP_SIGNAL interrupts it. */
void thread_signals(void)
{
	sigset_t only_stop;
	sigemptyset(&only_stop);
	sigaddset(&only_stop, STOP_SIGNAL);
	pthread_sigmask(SIG_UNBLOCK, &only_stop, NULL);
}

static void *worker_main(void *arg)
{
	struct plane *p = arg;
	thread_signals();
	struct worker w;
	worker_open(&w);
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
	worker_close(&w);
	return NULL;
}

void worker_open(struct worker *w)
{
	w->buf = malloc(REQUEST_BUF);
	w->data = malloc(DATA_BUF);
	pipe_open(w);
}

void worker_close(struct worker *w)
{
	pipe_close(w);
	free(w->buf);
	free(w->data);
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
	view_init(p);
	return p;
}

int plane_start(struct plane *p, int dev_fd)
{
	if (p->started)
		return -EBUSY;
	int flags = fcntl(dev_fd, F_GETFL);
	if (flags < 0 || fcntl(dev_fd, F_SETFL, flags & ~O_NONBLOCK) < 0)
		return -errno; /* a thread waits in read(2), never spins */
	if (stop_signal_ready() < 0)
		return -errno;
	p->dev_fd = dev_fd;
	p->started = start_threads(p->threads, p->n_threads, worker_main, p);
	if (p->started < p->n_threads) {
		plane_stop(p);
		return -EAGAIN;
	}
	return 0;
}

void plane_stop(struct plane *p)
{
	atomic_store(&p->stopping, 1);
	join_threads(p->threads, p->started);
	p->started = 0;
}

void plane_free(struct plane *p)
{
	if (!p)
		return;
	plane_stop(p);
	plane_control_stop(p);
	view_free(p);
	for (size_t i = 0; i < p->n_datasets; i++) {
		free(p->datasets[i]->pools);
		free(p->datasets[i]);
	}
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
	out->copied = atomic_load(&p->copied);
	out->hits = atomic_load(&p->served_files);
	out->forwarded = atomic_load(&p->forwarded);
	out->fallbacks = atomic_load(&p->fallbacks);
	out->hits_dropped = atomic_load(&p->hits_dropped);
	out->forgets = atomic_load(&p->forgets);
	out->opens = atomic_load(&p->opens);
	out->releases = atomic_load(&p->releases);
	out->backing_failures = atomic_load(&p->backing_failures);
	out->store_drops = atomic_load(&p->store_drops);
	out->view_opens = atomic_load(&p->view_opens);
	out->view_reads = atomic_load(&p->view_reads);
	out->view_read_bytes = atomic_load(&p->view_read_bytes);
	out->view_getattrs = atomic_load(&p->view_getattrs);
	out->view_releases = atomic_load(&p->view_releases);
	out->view_returned = atomic_load(&p->view_returned);
	out->view_forwarded = atomic_load(&p->view_forwarded);
	out->view_events_dropped = atomic_load(&p->view_events_dropped);
	out->view_waits = atomic_load(&p->view_waits);
	out->view_declined = atomic_load(&p->view_declined);
}
