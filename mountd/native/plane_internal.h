/* The native data plane's parts' shared state (plane.c, tables.c, passthrough.c):
 * constants, the kernel structures newer than <linux/fuse.h>, the plane's tables and
 * the functions one part gives the others. Not part of the module's interface. */
#ifndef QUIVER_PLANE_INTERNAL_H
#define QUIVER_PLANE_INTERNAL_H

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
	uint8_t condemned; /* withdrawn with wait (found changed): view files open on it fail */
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
	uint32_t *pools; /* a view's: each entry's pool; NULL for a dataset served exactly */
	uint32_t n_pools;
	uint32_t uid, gid;
	int64_t time_ns;
	int suspended;
	struct tree *t;
};

/* A thread's buffers: a request, a READ's bytes, and a pipe to splice them through. */
struct worker {
	char *buf, *data;
	int pipe[2]; /* -1: none (it could not be made, or broke): pread and writev */
	uint64_t page, pipe_pages; /* the page size; the pipe's buffers, a page (or part)
				    * each */
};

/* The views (view.c): a job's items queued for one pool, a ring */
/* A job's queue for one pool: its items, each tagged with Python's number of the
 * job's pass over the pool that handed it out. The plane serves the queue in order,
 * and moves on to a later pass's items by itself unless one of the pass it is in was
 * given back: then the job's opens go to Python (which hands that item out again)
 * until Python says the job's next pass has begun (plane_view_pass). */
struct view_entry {
	uint32_t item, pass;
};
struct view_queue {
	struct view_entry *entries;
	uint32_t head, n, cap;
	uint32_t pass;    /* the pass it serves */
	uint32_t opening; /* its items taken by OPENs not answered yet */
	uint32_t waiting; /* OPENs waiting for Python to queue an item (view_wait) */
	uint32_t declined; /* of them, those Python sent on to itself */
	uint32_t pushes;  /* times items were queued (a waiting OPEN sees another take them) */
	uint8_t held;     /* an item of that pass was given back: no later one is served */
};

/* A view job Python named (its id), of the view at base, for uid's processes. */
struct view_job {
	uint32_t id, uid;
	uint64_t base;
	uint32_t n_pools;
	struct view_queue *queues; /* by pool */
};

/* A process Python recognised as one of a job's, while its process group is pgid. */
struct view_pid {
	uint64_t base;
	uint32_t pid, job;
	int32_t pgid;
};

/* A view file opened here: the item it serves, its value file held open. */
struct view_open {
	uint64_t seq; /* 0: free; else the order of opens (a process's latest answers fstat) */
	int fd;
	uint32_t pid, job, item, slot, uid, gid; /* uid, gid: the view's (its attributes) */
	uint32_t opener_uid;
	int64_t time_ns;
	uint64_t inode, size;
	uint8_t digest[PLANE_DIGEST];
};

/* A view file Python opened for pid at inode (n opens). */
struct view_py_open {
	uint32_t pid, n;
	uint64_t inode;
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
	atomic_int kernel_cache_symlinks; /* the kernel's INIT offered FUSE_CACHE_SYMLINKS */
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

	/* ROOT/.quiver's connection (view.c): its threads, and the socket that takes the
	 * requests they do not answer to the process that serves them */
	int ctl_fd, ctl_fwd, ctl_started;
	int view_wake_fd; /* an eventfd: readable once a queue runs low or an item is given back */
	pthread_t *ctl_threads;
	atomic_int ctl_stopping;
	pthread_mutex_t fwd_lock; /* one request at a time on ctl_fwd */
	pthread_mutex_t view_lock; /* the jobs, pids, queues, opens and events below */
	pthread_cond_t view_settled; /* a queue's last OPEN under way answered */
	struct view_job **jobs;
	size_t n_jobs, cap_jobs;
	struct view_pid *pids;
	size_t n_pids;
	struct view_open *view_files; /* VIEW_OPENS, by file handle */
	size_t n_view_files;
	uint64_t open_seq;
	struct view_py_open *py_opens; /* VIEW_PY_OPENS */
	size_t n_py_opens, py_unrecorded; /* those past VIEW_PY_OPENS, not recorded */
	struct plane_view_event *events; /* a ring of VIEW_EVENTS */
	size_t event_start, event_count;
	uint32_t view_waiting; /* OPENs waiting in view_wait, every queue's */

	atomic_uint_fast64_t view_opens, view_reads, view_read_bytes, view_getattrs,
		view_releases, view_returned, view_forwarded, view_events_dropped, view_waits,
		view_declined;

	atomic_uint_fast64_t lookups, getattrs, reads, read_bytes, copied, served_files,
		forwarded, fallbacks, hits_dropped, forgets, opens, releases, backing_failures,
		store_drops;
};

/* tables.c */
struct slot *slot_at(const struct plane *p, uint32_t i);
struct dataset *dataset_of(const struct plane *p, uint64_t inode, uint32_t *node);
uint32_t tree_lookup(const struct plane *p, const struct tree *t, uint32_t parent,
		     const char *name, size_t len);
void tree_free(struct tree *t);
void item_unref(struct plane *p, uint32_t i);

/* passthrough.c */
void backing_drop(struct plane *p, struct slot *s, int forget);
int do_open(struct plane *p, const struct fuse_in_header *in, const struct fuse_open_in *arg);
int do_release(struct plane *p, const struct fuse_in_header *in,
	       const struct fuse_release_in *arg);
void saw_init(struct plane *p, const struct fuse_in_header *in, const char *arg, size_t len);

/* view.c */
void view_init(struct plane *p);
void view_free(struct plane *p);

/* plane.c */
void reply_on(int dev_fd, uint64_t unique, int error, const void *arg, size_t len);
void reply(struct plane *p, uint64_t unique, int error, const void *arg, size_t len);
void record_hit(struct plane *p, uint64_t inode, uint64_t started);
uint64_t now_ns(void);
struct slot *served_item(struct plane *p, uint64_t inode, uint32_t *index, uint64_t *size,
			 char *path);
void value_path(const struct plane *p, const char *name, char *path);
double fill_attr(const struct plane *p, const struct dataset *ds, uint32_t node,
		 struct fuse_attr *a);
uint64_t timeout_sec(double t);
uint32_t timeout_nsec(double t);
void worker_open(struct worker *w);
void worker_close(struct worker *w);
int file_fill(struct worker *w, uint64_t unique, int fd, uint64_t off, uint64_t n);
void file_send(struct plane *p, struct worker *w, int dev_fd, uint64_t unique, uint64_t n,
	       int filled);
void join_threads(pthread_t *threads, int n);
int stop_signal_ready(void);
void thread_signals(void);
int start_threads(pthread_t *threads, int n, void *(*main)(void *), void *arg);

#endif
