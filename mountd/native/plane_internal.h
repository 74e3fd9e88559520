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
	atomic_uchar fresh; /* none of its file's pages were cached at its last READ from 0 */
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

/* plane.c */
void reply(struct plane *p, uint64_t unique, int error, const void *arg, size_t len);
void record_hit(struct plane *p, uint64_t inode, uint64_t started);
uint64_t now_ns(void);
struct slot *served_item(struct plane *p, uint64_t inode, uint32_t *index, uint64_t *size,
			 char *path);

#endif
