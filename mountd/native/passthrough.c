/* FUSE passthrough (protocol 7.40, Linux 6.9): the INIT reply that asks for it (libfuse
 * 3.14 cannot; it also asks for symlinks to be cached), and OPENs of served items answered with their value files as backing
 * files, which the kernel then reads itself. */
#define _GNU_SOURCE
#include "plane_internal.h"

/* Under backing_lock: close slot s's backing id where no open uses it (else its last
 * RELEASE does). `forget`: the slot itself is going. */
void backing_drop(struct plane *p, struct slot *s, int forget)
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
int do_open(struct plane *p, const struct fuse_in_header *in,
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

int do_release(struct plane *p, const struct fuse_in_header *in,
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

/* The INIT request: whether the kernel offers passthrough and symlink caching, and
 * which reply to patch. */
void saw_init(struct plane *p, const struct fuse_in_header *in, const char *arg,
		     size_t len)
{
	struct fuse_init_in init;
	memset(&init, 0, sizeof init);
	memcpy(&init, arg, len < sizeof init ? len : sizeof init);
	int offered = (init.flags & FUSE_INIT_EXT) && (init.flags2 & INIT_PASSTHROUGH);
	atomic_store(&p->kernel_passthrough, offered);
	atomic_store(&p->kernel_cache_symlinks, (init.flags & FUSE_CACHE_SYMLINKS) != 0);
	atomic_store(&p->init_unique, in->unique);
}

ssize_t plane_write(struct plane *p, const struct iovec *iov, int count)
{
	/* libfuse 3.14 (and pyfuse3) cannot ask for passthrough or for READLINK's answers to
	 * be cached: its INIT reply is given the flags. A view's name is a link whose
	 * target never changes while its inode lives (inodes are never used again), so the
	 * kernel may keep it: a path through it then costs no READLINK. Passthrough also
	 * gets a stack depth of 1 (the store's file system is the only one below). */
	const struct fuse_out_header *out = iov[0].iov_base;
	if (count >= 2 && iov[0].iov_len >= sizeof *out && out->error == 0 &&
	    iov[1].iov_len >= sizeof(struct fuse_init_out) &&
	    out->unique == atomic_load(&p->init_unique)) {
		struct fuse_init_out *init = iov[1].iov_base;
		if (atomic_load(&p->kernel_cache_symlinks))
			init->flags |= FUSE_CACHE_SYMLINKS;
		if (atomic_load(&p->passthrough) && atomic_load(&p->kernel_passthrough)) {
			init->flags |= FUSE_INIT_EXT;
			init->flags2 |= INIT_PASSTHROUGH;
			init->unused[0] = 1; /* max_stack_depth */
		}
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
