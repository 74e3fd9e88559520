/* The native data plane: threads that read the datasets' /dev/fuse descriptor, answer
 * READ, LOOKUP and GETATTR of registered dataset inodes themselves, without Python, and
 * hand every other request to mountd's trio thread (plane_take).
 *
 * Python keeps the policy: it registers dataset trees (plane_add_dataset), says which
 * items are stored and verified and where (plane_serve), and withdraws them
 * (plane_withdraw) before their files go. What the threads do is counted
 * (plane_counters) and each first READ of a file is reported (plane_drain_hits), so the
 * store's recency and the read counters see every hit. */
#ifndef QUIVER_PLANE_H
#define QUIVER_PLANE_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <sys/uio.h>

#define PLANE_DIGEST 32 /* SHA-256 */
#define PLANE_NAME 32   /* a value file's name: 128 bits in hex */

struct plane;

struct plane_counters {
	uint64_t lookups;    /* LOOKUPs answered natively (found or ENOENT) */
	uint64_t getattrs;   /* GETATTRs answered natively */
	uint64_t reads;      /* READs answered natively */
	uint64_t read_bytes; /* bytes those READs returned */
	uint64_t copied;     /* of those READs, copied through the thread (no pipe to splice) */
	uint64_t hits;       /* READs at offset 0 answered natively: files served */
	uint64_t forwarded;  /* requests handed to Python */
	uint64_t fallbacks;  /* READs of served items handed to Python: file gone or short */
	uint64_t hits_dropped; /* hits not reported: Python drained too slowly */
	uint64_t forgets;    /* FORGETs and BATCH_FORGETs, dropped: mountd counts no lookups */
	uint64_t opens;      /* passthrough: OPENs answered with a backing file */
	uint64_t releases;   /* and their RELEASEs */
	uint64_t backing_failures; /* OPENs of served items the kernel gave no backing id */
	uint64_t store_drops; /* store files whose pages a READ brought in and then dropped */
	/* ROOT/.quiver's connection (the views) */
	uint64_t view_opens;    /* view files opened here, with an item queued for the job */
	uint64_t view_reads;    /* their READs */
	uint64_t view_read_bytes;
	uint64_t view_getattrs; /* their GETATTRs (fstat) */
	uint64_t view_releases; /* their RELEASEs */
	uint64_t view_returned; /* queued items given back to Python: withdrawn, file gone */
	uint64_t view_forwarded; /* the connection's requests handed to its process */
	uint64_t view_events_dropped; /* opens and returns not reported: drained too slowly */
	uint64_t view_waits;    /* OPENs that found their queue empty and asked Python */
	uint64_t view_declined; /* of them, those that went to Python: declined, what was
				 * queued taken by another OPEN, or VIEW_WAIT_S passed */
};

/* A plane for the value files under store_dir, served by `threads` threads once
 * started. Timeouts are the attributes' and names' cache times the kernel is given: a
 * dataset's root directory's, and every other node's. NULL with errno set on failure. */
struct plane *plane_new(const char *store_dir, int threads, double root_timeout,
			double timeout);
/* Stops the threads if running, frees everything. The descriptor is not closed. */
void plane_free(struct plane *p);

/* Start the threads reading dev_fd (the session's /dev/fuse). 0 or -errno. */
int plane_start(struct plane *p, int dev_fd);
/* Stop and join the threads (each read is interrupted). Requests not yet taken stay
 * queued. Idempotent. */
void plane_stop(struct plane *p);

/* Readable (an eventfd in semaphore mode) while a request waits for Python. */
int plane_event_fd(const struct plane *p);
/* The next request for Python, copied into buf: its length; -1 with errno EAGAIN when
 * none waits, ENODEV once the session has ended (the kernel unmounted it), EINTR for
 * one longer than the buffer (answered EIO). */
ssize_t plane_take(struct plane *p, void *buf, size_t len);
/* A reply from Python, written to the session's descriptor. */
ssize_t plane_write(struct plane *p, const struct iovec *iov, int count);
int plane_dev_fd(const struct plane *p);

/* Passthrough (off by default): an OPEN of a served item is answered with the value
 * file as its backing file, and READs go to Python (only files it opened are read).
 * Set before the kernel's INIT is answered, whose reply then asks for it where the
 * kernel offered it (plane_passthrough_offered, known once INIT was read). */
void plane_set_passthrough(struct plane *p, int on);
int plane_passthrough_offered(const struct plane *p);

/* A digest's tree: node 0 its root, nodes 1 .. n_dirs - 1 directories, node n_dirs + i
 * entry i. parents[node] is a node's directory, its name names[name_ends[node - 1] ..
 * name_ends[node]) (node 0's is empty), sizes[i] and digests[32 i ..] entry i's. */
struct plane_tree {
	uint32_t n_dirs, n_files;
	const uint32_t *parents, *name_ends;
	const char *names;
	const uint64_t *sizes;
	const uint8_t *digests;
};

/* Whether a tree of the digest `identity` (32 bytes) is held: its datasets share it. */
int plane_has_tree(struct plane *p, const uint8_t *identity);
/* A dataset at inodes base .. base + its tree's nodes - 1, registered from the digest
 * `identity`: its tree is the one held for it, else `tree` (NULL: -ENOENT). Attributes
 * are those of mountd's Python handlers: owned by uid:gid, times time_ns. A view has
 * `pools` (n_pools of them: each entry's pool), and is served on ROOT/.quiver's
 * connection only; a dataset served exactly has none (NULL). 0, or -errno (EEXIST: the
 * range overlaps another's; EINVAL: a tree not well formed, or pools not one an
 * entry). */
int plane_add_dataset(struct plane *p, uint64_t base, const uint8_t *identity, uint32_t uid,
		      uint32_t gid, int64_t time_ns, const struct plane_tree *tree,
		      const uint32_t *pools, uint32_t n_pools);
/* Forget the dataset at base; its reads in flight finish. 0 or -ENOENT. */
int plane_remove_dataset(struct plane *p, uint64_t base);
/* While suspended, a dataset's READs go to Python (which refuses them). */
int plane_suspend_dataset(struct plane *p, uint64_t base, int suspended);

/* The item `digest` is stored and verified in value file `name` (PLANE_NAME hex
 * characters): serve its READs (of an entry whose size is the file's). 1 if a
 * registered dataset names it, else 0 (nothing is kept); -EINVAL for a bad name. */
int plane_serve(struct plane *p, const uint8_t *digest, const char *name);
/* Serve `digest` no more. With `wait`, returns once no READ or OPEN of it is in
 * flight: no reply with its bytes is sent after. (The inodes naming it are Python's to
 * find: MountTable.inodes_naming.) */
void plane_withdraw(struct plane *p, const uint8_t *digest, int wait);

/* A file served (its first READ, or a passthrough OPEN): its inode, and the
 * nanoseconds its request took here. */
struct plane_hit {
	uint64_t inode;
	uint64_t ns;
};

/* ---- the substitutable views (view.c), on ROOT/.quiver's connection ----
 *
 * Python keeps the policy: which items a job gets, once per pass. It queues, per job
 * and pool, items cached and verified that it has handed out to that job
 * (plane_view_push), and names the processes it recognised as the job's
 * (plane_view_pid). The connection's threads answer the OPEN of a view file by a
 * process of a job (the same uid, the same process group as when Python recognised it)
 * with the next item queued for that job and the file's pool, and that open's READ,
 * GETATTR (by the opening process: fstat) and RELEASE; a view file's GETATTR by a
 * process with none open there (plane_view_python_open); and every FLUSH and IOCTL
 * (ENOSYS, as pyfuse3 answers them); every other request goes
 * to the process that serves the connection, through a socket (a stream of requests).
 * Each open is reported (plane_view_drain), and so is each queued item given back
 * (withdrawn, or its file gone): Python hands it out again, in the same pass (the
 * plane serves no later pass's item meanwhile). */

/* Serve ROOT/.quiver's connection dev_fd with `threads` threads, forwarding what they
 * do not answer to the socket fwd_fd. The plane owns both descriptors from now on,
 * even on failure. 0 or -errno. */
int plane_control_start(struct plane *p, int dev_fd, int fwd_fd, int threads);
/* Join those threads, close both descriptors and the view files open there (the
 * connection is gone). Idempotent. */
void plane_control_stop(struct plane *p);

/* Job `id` of the view at base, for uid. 0, -ENOENT (no view there), -EEXIST, -ENOMEM. */
int plane_view_job(struct plane *p, uint32_t id, uint64_t base, uint32_t uid);
/* Forget job `id`, its queues and the processes named for it. */
void plane_view_forget(struct plane *p, uint32_t id);
/* Process pid, in process group pgid, reads the view at base for job `id` (replacing
 * what was said of pid there). 0, -ENOENT (no such job), -ENOSPC (too many). */
int plane_view_pid(struct plane *p, uint32_t id, uint32_t pid, int32_t pgid);
/* Queue items (entry indexes, each of pool `pool`) for job `id`, handed out in its
 * pass number `pass` over the pool (a pass never behind a later one's). 0, -ENOENT,
 * -EINVAL (an item not of that pool: none is queued), -ENOMEM. */
int plane_view_push(struct plane *p, uint32_t id, uint32_t pool, const uint32_t *items,
		    size_t n, uint32_t pass);
/* Job `id`'s pass number `pass` over pool has begun in Python (every item of the
 * earlier ones served): the plane serves its items, and a later pass's after them,
 * again. Ignored for a pass before the one the plane serves. */
void plane_view_pass(struct plane *p, uint32_t id, uint32_t pool, uint32_t pass);
/* Python opened (delta 1) or released a view file for pid at inode (-1: an open
 * recorded, -2: one that was not): that process's GETATTRs of it are Python's while
 * open. Any other process's GETATTR of a view file is answered with the file's own
 * attributes. 0, or -ENOSPC/-ENOMEM where an open could not be recorded (every
 * GETATTR of a view file is then Python's until it is released). */
int plane_view_python_open(struct plane *p, uint32_t pid, uint64_t inode, int delta);

/* An OPEN of job `id`'s waits on pool's empty queue (a VIEW_NEEDED event): Python
 * answers it itself (the plane forwards it), not by queueing an item. Ignored where
 * no OPEN waits. */
void plane_view_decline(struct plane *p, uint32_t id, uint32_t pool);
/* How many OPENs of job `id`'s wait on pool's empty queue, less those declined. */
uint32_t plane_view_waiting(struct plane *p, uint32_t id, uint32_t pool);

/* Take back the next item queued for job `id` and pool (an open through Python gets
 * it): 0, *item and the number of the pass it was queued in, else -ENOENT (none). */
int plane_view_take(struct plane *p, uint32_t id, uint32_t pool, uint32_t *item,
		    uint32_t *pass);
/* The item a view file open here at `inode` by pid (its latest) serves: 0 and *item,
 * else -ENOENT. */
int plane_view_opened(struct plane *p, uint32_t pid, uint64_t inode, uint32_t *item);

/* An eventfd, readable once a job's queue of a pool is down to a few items, or an item
 * was given back: Python drains the events and tops the queues up. */
int plane_view_wake_fd(const struct plane *p);

/* A view file opened here, a queued item given back, or an OPEN waiting on an empty
 * queue (item: its pool; pass: the one the queue serves). */
enum plane_view_kind { VIEW_OPENED = 0, VIEW_RETURNED = 1, VIEW_NEEDED = 2 };
struct plane_view_event {
	uint32_t job, item;
	uint32_t kind; /* enum plane_view_kind */
	uint32_t pass; /* the item's, as queued */
	uint64_t ns;   /* the OPEN's time here */
};

/* Up to max of the events since the last call. */
size_t plane_view_drain(struct plane *p, struct plane_view_event *events, size_t max);

/* Up to max of the files served since the last call. */
size_t plane_drain_hits(struct plane *p, struct plane_hit *hits, size_t max);
void plane_counters(struct plane *p, struct plane_counters *out);

#endif
