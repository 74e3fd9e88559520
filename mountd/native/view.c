/* The substitutable views' cached opens (plane.h, "the substitutable views"): threads
 * that read ROOT/.quiver's connection, answer the OPEN of a view file with the next
 * item Python queued for the opener's job and the file's pool, and that open's READ,
 * GETATTR and RELEASE, a view file's GETATTR by a process with none open (where
 * Python has none open for it either), and every FLUSH and IOCTL (ENOSYS); the rest of
 * the connection's requests go to the process that serves it, through a socket.
 *
 * The jobs, the processes named for them, their queues, the open files and the events
 * for Python are under view_lock; an open file's record is only used by the requests
 * of that open (the kernel sends none after its RELEASE). The tables (datasets, slots)
 * are read under the plane's read lock, as in plane.c. */
#define _GNU_SOURCE
#include "plane_internal.h"

#include <sys/socket.h>

#define VIEW_OPENS 4096 /* view files open here at once; past it, Python opens them */
#define VIEW_OPENS_PER_UID 1024 /* of them, one uid's (its others open through Python) */
#define VIEW_PIDS 8192  /* processes named for jobs; past it, Python answers theirs */
#define VIEW_EVENTS 65536
#define VIEW_PY_OPENS 8192 /* view files Python has open, recorded (GETATTR is its) */
#define VIEW_LOW 2 /* a queue left this short wakes Python to top it up */
#define VIEW_WAIT_S 10 /* seconds an OPEN waits for Python to queue an item, then Python's */

void view_init(struct plane *p)
{
	p->ctl_fd = p->ctl_fwd = -1;
	p->view_wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	pthread_mutex_init(&p->fwd_lock, NULL);
	pthread_mutex_init(&p->view_lock, NULL);
	pthread_cond_init(&p->view_settled, NULL);
}

static void job_free(struct view_job *job)
{
	for (uint32_t i = 0; job->queues && i < job->n_pools; i++)
		free(job->queues[i].entries);
	free(job->queues);
	free(job);
}

void view_free(struct plane *p)
{
	for (size_t i = 0; i < p->n_jobs; i++)
		job_free(p->jobs[i]);
	free(p->jobs);
	free(p->pids);
	free(p->view_files);
	free(p->events);
	free(p->py_opens);
	if (p->view_wake_fd >= 0)
		close(p->view_wake_fd);
	pthread_mutex_destroy(&p->fwd_lock);
	pthread_mutex_destroy(&p->view_lock);
	pthread_cond_destroy(&p->view_settled);
}

/* ---- what Python says (under view_lock) ---- */
static struct view_job *job_by_id(const struct plane *p, uint32_t id, size_t *at)
{
	for (size_t i = 0; i < p->n_jobs; i++)
		if (p->jobs[i]->id == id) {
			if (at)
				*at = i;
			return p->jobs[i];
		}
	return NULL;
}

/* Under view_lock: job id's queue of pool, or NULL where the job is gone. */
static struct view_queue *queue_of(struct plane *p, uint32_t id, uint32_t pool)
{
	struct view_job *job = job_by_id(p, id, NULL);
	return job && pool < job->n_pools ? &job->queues[pool] : NULL;
}

int plane_view_job(struct plane *p, uint32_t id, uint64_t base, uint32_t uid)
{
	uint32_t node, n_pools = 0;
	pthread_rwlock_rdlock(&p->lock);
	struct dataset *ds = dataset_of(p, base, &node);
	int found = ds && ds->pools && node == 0;
	if (found)
		n_pools = ds->n_pools;
	pthread_rwlock_unlock(&p->lock);
	if (!found)
		return -ENOENT;
	struct view_job *job = calloc(1, sizeof *job);
	if (!job || !(job->queues = calloc(n_pools ? n_pools : 1, sizeof *job->queues))) {
		free(job);
		return -ENOMEM;
	}
	job->id = id;
	job->uid = uid;
	job->base = base;
	job->n_pools = n_pools;
	int error = 0;
	pthread_mutex_lock(&p->view_lock);
	if (job_by_id(p, id, NULL)) {
		error = -EEXIST;
	} else if (p->n_jobs == p->cap_jobs) {
		size_t cap = p->cap_jobs ? 2 * p->cap_jobs : 16;
		struct view_job **grown = realloc(p->jobs, cap * sizeof *grown);
		if (grown) {
			p->jobs = grown;
			p->cap_jobs = cap;
		} else {
			error = -ENOMEM;
		}
	}
	if (!error)
		p->jobs[p->n_jobs++] = job;
	pthread_mutex_unlock(&p->view_lock);
	if (error)
		job_free(job);
	return error;
}

void plane_view_forget(struct plane *p, uint32_t id)
{
	size_t at;
	pthread_mutex_lock(&p->view_lock);
	struct view_job *job = job_by_id(p, id, &at);
	if (job) {
		p->jobs[at] = p->jobs[--p->n_jobs];
		pthread_cond_broadcast(&p->view_settled); /* nothing to wait for of it now */
	}
	for (size_t i = 0; i < p->n_pids;)
		if (p->pids[i].job == id)
			p->pids[i] = p->pids[--p->n_pids];
		else
			i++;
	pthread_mutex_unlock(&p->view_lock);
	if (job)
		job_free(job);
}

int plane_view_pid(struct plane *p, uint32_t id, uint32_t pid, int32_t pgid)
{
	int error = 0;
	pthread_mutex_lock(&p->view_lock);
	struct view_job *job = job_by_id(p, id, NULL);
	if (!job) {
		error = -ENOENT;
	} else if (!p->pids && !(p->pids = malloc(VIEW_PIDS * sizeof *p->pids))) {
		error = -ENOMEM;
	} else {
		struct view_pid *at = NULL;
		for (size_t i = 0; i < p->n_pids && !at; i++)
			if (p->pids[i].pid == pid && p->pids[i].base == job->base)
				at = &p->pids[i];
		if (!at && p->n_pids < VIEW_PIDS)
			at = &p->pids[p->n_pids++];
		if (at)
			*at = (struct view_pid){.base = job->base, .pid = pid, .job = id, .pgid = pgid};
		else
			error = -ENOSPC;
	}
	pthread_mutex_unlock(&p->view_lock);
	return error;
}

static int queue_room(struct view_queue *q, size_t more)
{
	if (q->n + more <= q->cap)
		return 0;
	size_t cap = q->cap ? q->cap : 16;
	while (cap < q->n + more)
		cap *= 2;
	if (cap > UINT32_MAX)
		return -ENOMEM;
	struct view_entry *entries = malloc(cap * sizeof *entries);
	if (!entries)
		return -ENOMEM;
	for (uint32_t i = 0; i < q->n; i++) /* unrolled from the ring */
		entries[i] = q->entries[(q->head + i) % q->cap];
	free(q->entries);
	q->entries = entries;
	q->head = 0;
	q->cap = (uint32_t)cap;
	return 0;
}

int plane_view_push(struct plane *p, uint32_t id, uint32_t pool, const uint32_t *items,
		    size_t n, uint32_t pass)
{
	int error = 0;
	pthread_rwlock_rdlock(&p->lock);
	pthread_mutex_lock(&p->view_lock);
	struct view_job *job = job_by_id(p, id, NULL);
	uint32_t node;
	struct dataset *ds = job ? dataset_of(p, job->base, &node) : NULL;
	if (!job || !ds || !ds->pools || node != 0)
		error = -ENOENT; /* the view is gone: its job soon is */
	else if (pool >= job->n_pools)
		error = -EINVAL;
	for (size_t i = 0; !error && i < n; i++)
		if (items[i] >= ds->t->n_files || ds->pools[items[i]] != pool)
			error = -EINVAL;
	if (!error)
		error = queue_room(&job->queues[pool], n);
	if (!error) {
		struct view_queue *q = &job->queues[pool];
		for (size_t i = 0; i < n; i++)
			q->entries[(q->head + q->n++) % q->cap] =
				(struct view_entry){.item = items[i], .pass = pass};
		if (n)
			q->pushes++;
		if (q->waiting && n)
			pthread_cond_broadcast(&p->view_settled);
	}
	pthread_mutex_unlock(&p->view_lock);
	pthread_rwlock_unlock(&p->lock);
	return error;
}

void plane_view_pass(struct plane *p, uint32_t id, uint32_t pool, uint32_t pass)
{
	pthread_mutex_lock(&p->view_lock);
	struct view_queue *q = queue_of(p, id, pool);
	if (q && pass > q->pass) {
		q->pass = pass;
		q->held = 0;
	}
	pthread_mutex_unlock(&p->view_lock);
}

void plane_view_decline(struct plane *p, uint32_t id, uint32_t pool)
{
	pthread_mutex_lock(&p->view_lock);
	struct view_queue *q = queue_of(p, id, pool);
	if (q && q->declined < q->waiting) {
		q->declined++;
		pthread_cond_broadcast(&p->view_settled);
	}
	pthread_mutex_unlock(&p->view_lock);
}

uint32_t plane_view_waiting(struct plane *p, uint32_t id, uint32_t pool)
{
	pthread_mutex_lock(&p->view_lock);
	struct view_queue *q = queue_of(p, id, pool);
	uint32_t n = q ? q->waiting - q->declined : 0;
	pthread_mutex_unlock(&p->view_lock);
	return n;
}

int plane_view_take(struct plane *p, uint32_t id, uint32_t pool, uint32_t *item,
		    uint32_t *pass)
{
	int error = -ENOENT;
	pthread_mutex_lock(&p->view_lock);
	struct view_queue *q = queue_of(p, id, pool);
	if (q && q->n) {
		*item = q->entries[q->head].item;
		*pass = q->entries[q->head].pass;
		q->head = (q->head + 1) % q->cap;
		q->n--;
		error = 0;
	}
	pthread_mutex_unlock(&p->view_lock);
	return error;
}

/* Under view_lock: an open file's or a given back item's report for Python. */
static void view_event(struct plane *p, uint32_t job, struct view_entry e,
		       enum plane_view_kind kind, uint64_t ns)
{
	if (!p->events && !(p->events = malloc(VIEW_EVENTS * sizeof *p->events))) {
		atomic_fetch_add_explicit(&p->view_events_dropped, 1, memory_order_relaxed);
		return;
	}
	if (p->event_count == VIEW_EVENTS) {
		atomic_fetch_add_explicit(&p->view_events_dropped, 1, memory_order_relaxed);
		return;
	}
	p->events[(p->event_start + p->event_count++) % VIEW_EVENTS] =
		(struct plane_view_event){.job = job, .item = e.item,
					  .kind = (uint32_t)kind, .pass = e.pass, .ns = ns};
}

static void view_wake(struct plane *p)
{
	uint64_t one = 1;
	(void)!write(p->view_wake_fd, &one, sizeof one);
}

int plane_view_wake_fd(const struct plane *p) { return p->view_wake_fd; }

size_t plane_view_drain(struct plane *p, struct plane_view_event *events, size_t max)
{
	pthread_mutex_lock(&p->view_lock);
	size_t n = p->event_count < max ? p->event_count : max;
	for (size_t i = 0; i < n; i++)
		events[i] = p->events[(p->event_start + i) % VIEW_EVENTS];
	p->event_start = (p->event_start + n) % VIEW_EVENTS;
	p->event_count -= n;
	pthread_mutex_unlock(&p->view_lock);
	return n;
}

/* Under view_lock: the open record pid has at inode, its latest; NULL if none. */
static struct view_open *opened_by(struct plane *p, uint32_t pid, uint64_t inode)
{
	struct view_open *found = NULL;
	for (size_t i = 0; i < p->n_view_files; i++) {
		struct view_open *o = &p->view_files[i];
		if (o->seq && o->fd >= 0 && o->pid == pid && o->inode == inode &&
		    (!found || o->seq > found->seq))
			found = o;
	}
	return found;
}

int plane_view_opened(struct plane *p, uint32_t pid, uint64_t inode, uint32_t *item)
{
	pthread_mutex_lock(&p->view_lock);
	struct view_open *o = opened_by(p, pid, inode);
	if (o)
		*item = o->item;
	pthread_mutex_unlock(&p->view_lock);
	return o ? 0 : -ENOENT;
}

int plane_view_python_open(struct plane *p, uint32_t pid, uint64_t inode, int delta)
{
	int error = 0;
	pthread_mutex_lock(&p->view_lock);
	struct view_py_open *at = NULL;
	for (size_t i = 0; i < p->n_py_opens && !at; i++)
		if (p->py_opens[i].pid == pid && p->py_opens[i].inode == inode)
			at = &p->py_opens[i];
	if (delta > 0) {
		if (!at && !p->py_opens &&
		    !(p->py_opens = malloc(VIEW_PY_OPENS * sizeof *p->py_opens)))
			error = -ENOMEM;
		else if (!at && p->n_py_opens == VIEW_PY_OPENS)
			error = -ENOSPC;
		else if (!at)
			*(at = &p->py_opens[p->n_py_opens++]) =
				(struct view_py_open){.pid = pid, .inode = inode};
		if (at)
			at->n++;
		else
			p->py_unrecorded++; /* every path's GETATTR is Python's meanwhile */
	} else if (delta == -1) {
		if (at && !--at->n)
			*at = p->py_opens[--p->n_py_opens];
	} else if (p->py_unrecorded) {
		p->py_unrecorded--;
	}
	pthread_mutex_unlock(&p->view_lock);
	return error;
}

/* ---- the connection's requests answered here (1), or forwarded (0) ---- */

/* Under view_lock: the job pid reads the view at base for, where Python named pid for
 * it while pid's process group was the one it is now, and it is uid's. */
static struct view_job *job_of(struct plane *p, uint64_t base, uint32_t uid, uint32_t pid,
			       int32_t pgid)
{
	for (size_t i = 0; i < p->n_pids; i++) {
		const struct view_pid *known = &p->pids[i];
		if (known->pid != pid || known->base != base)
			continue;
		if (known->pgid != pgid) /* another process group now: Python decides */
			return NULL;
		struct view_job *job = job_by_id(p, known->job, NULL);
		return job && job->uid == uid ? job : NULL;
	}
	return NULL;
}

/* Under view_lock: a free open record, reserved (fd -1), for an open by uid; NULL where
 * VIEW_OPENS are, or VIEW_OPENS_PER_UID of uid's: a user holding files open leaves
 * room for the others'. */
static struct view_open *open_reserve(struct plane *p, uint32_t uid)
{
	if (!p->view_files && !(p->view_files = calloc(VIEW_OPENS, sizeof *p->view_files)))
		return NULL;
	size_t held = 0;
	for (size_t i = 0; i < p->n_view_files; i++)
		held += p->view_files[i].seq && p->view_files[i].opener_uid == uid;
	if (held >= VIEW_OPENS_PER_UID)
		return NULL;
	for (size_t i = 0; i < p->n_view_files; i++)
		if (!p->view_files[i].seq) {
			p->view_files[i].seq = ++p->open_seq;
			p->view_files[i].fd = -1;
			return &p->view_files[i];
		}
	if (p->n_view_files == VIEW_OPENS)
		return NULL;
	struct view_open *o = &p->view_files[p->n_view_files++];
	o->seq = ++p->open_seq;
	o->fd = -1;
	return o;
}

/* Under view_lock: e, taken from job id's queue q (NULL: the job is gone), given back
 * to Python (withdrawn, or its file gone). A pass with an item given back is held: its
 * later passes' items wait for Python to hand that one out again (plane_view_pass). */
static void given_back(struct plane *p, uint32_t id, struct view_queue *q, struct view_entry e)
{
	view_event(p, id, e, VIEW_RETURNED, 0);
	view_wake(p);
	atomic_fetch_add_explicit(&p->view_returned, 1, memory_order_relaxed);
	if (q && e.pass == q->pass)
		q->held = 1;
}

/* Under view_lock: an OPEN of job id's found its queue of pool empty, none of its
 * OPENs under way: Python is asked to choose (a VIEW_NEEDED event), and the OPEN waits
 * until an item is queued (1: take it), or Python declines, another OPEN takes what
 * was queued (it asked for one), the job goes, the connection stops or VIEW_WAIT_S
 * pass (0: the OPEN goes to Python). So a job's every
 * open is answered here, a miss too once Python has it in the store, and none costs
 * the round trips through the connection's process. At most half the connection's
 * threads wait at once: the rest serve the other requests. */
static int view_wait(struct plane *p, uint32_t id, uint32_t pool)
{
	struct view_queue *q = queue_of(p, id, pool);
	if (!q || p->view_waiting >= (uint32_t)p->ctl_started / 2)
		return 0;
	view_event(p, id, (struct view_entry){.item = pool, .pass = q->pass}, VIEW_NEEDED, 0);
	view_wake(p);
	atomic_fetch_add_explicit(&p->view_waits, 1, memory_order_relaxed);
	q->waiting++;
	p->view_waiting++;
	uint32_t pushes = q->pushes;
	struct timespec deadline;
	clock_gettime(CLOCK_REALTIME, &deadline);
	deadline.tv_sec += VIEW_WAIT_S;
	int item = 0, timed_out = 0;
	while ((q = queue_of(p, id, pool)) && !atomic_load(&p->ctl_stopping)) {
		if (q->n) {
			item = 1;
			break;
		}
		/* another OPEN took what was queued, or Python is slow: Python's */
		if (q->pushes != pushes || timed_out)
			break;
		if (q->declined) {
			q->declined--;
			break;
		}
		timed_out = pthread_cond_timedwait(&p->view_settled, &p->view_lock, &deadline) ==
			    ETIMEDOUT;
	}
	if (!item)
		atomic_fetch_add_explicit(&p->view_declined, 1, memory_order_relaxed);
	p->view_waiting--;
	if (q && !--q->waiting)
		q->declined = 0;
	return item;
}

/* The OPEN of a view file by a process of a job with an item queued for the file's
 * pool: that item's value file, held open for the file's READs. An item withdrawn
 * since it was queued, or whose file is gone or not its size, is given back to
 * Python, and the next one of its pass tried. A later pass's first item is served
 * once every OPEN that took one of the pass before is answered, none given back:
 * else Python answers, and hands that item out again first (an epoch of a job's
 * loader opens each item once). */
static int view_open(struct plane *p, const struct fuse_in_header *in,
		     const struct fuse_open_in *arg)
{
	if ((arg->flags & O_ACCMODE) != O_RDONLY)
		return 0; /* Python refuses it */
	uint64_t started = now_ns();
	pid_t group = getpgid((pid_t)in->pid);
	if (group < 0)
		return 0; /* gone, or not in mountd's pid namespace: Python's "uid" job */
	int asked = 0; /* Python was asked for an item once: the next empty queue is its */
	for (;;) {
		uint32_t node, slot_index = 0, job_id = 0, pool = 0;
		struct view_entry e = {0};
		uint64_t size = 0;
		char name[PLANE_NAME], path[PATH_MAX];
		struct view_open *o = NULL;
		struct slot *s = NULL;
		int settle = 0, wait = 0;
		pthread_rwlock_rdlock(&p->lock);
		struct dataset *ds = dataset_of(p, in->nodeid, &node);
		if (!ds || !ds->pools || ds->suspended || node < ds->t->n_dirs) {
			pthread_rwlock_unlock(&p->lock);
			return 0; /* Python refuses a suspended view's reads */
		}
		pool = ds->pools[node - ds->t->n_dirs];
		pthread_mutex_lock(&p->view_lock);
		struct view_job *job = job_of(p, ds->base, in->uid, in->pid, group);
		struct view_queue *q = job && pool < job->n_pools ? &job->queues[pool] : NULL;
		if (q && q->n && q->entries[q->head].pass > q->pass) { /* a later pass's */
			if (q->held)
				q = NULL; /* Python hands out the item given back first */
			else if (q->opening)
				settle = 1;
			else
				q->pass = q->entries[q->head].pass;
		}
		if (q && q->n && !settle && (o = open_reserve(p, in->uid))) {
			e = q->entries[q->head];
			q->head = (q->head + 1) % q->cap;
			if (--q->n == VIEW_LOW)
				view_wake(p);
			slot_index = ds->t->slots[e.item];
			s = slot_at(p, slot_index);
			if (s->served) {
				q->opening++;
				atomic_fetch_add(&s->inflight, 1);
				size = ds->t->sizes[e.item];
				memcpy(name, s->name, PLANE_NAME);
				*o = (struct view_open){.seq = o->seq, .fd = -1, .pid = in->pid,
							.job = job->id, .item = e.item,
							.opener_uid = in->uid,
							.slot = slot_index, .uid = ds->uid,
							.gid = ds->gid, .time_ns = ds->time_ns,
							.inode = in->nodeid, .size = size};
				memcpy(o->digest, s->digest, PLANE_DIGEST);
			} else { /* withdrawn since it was queued */
				given_back(p, job->id, q, e);
				o->seq = 0;
				s = NULL;
			}
		}
		if (q && !q->n && !settle && !o) { /* none queued: Python is asked, once */
			if (q->opening)     /* the OPENs under way first: their reports */
				settle = 1; /* reach Python before the question */
			else
				wait = !asked;
		}
		if (job)
			job_id = job->id;
		pthread_rwlock_unlock(&p->lock);
		if (wait) {
			asked = 1;
			int queued = view_wait(p, job_id, pool);
			pthread_mutex_unlock(&p->view_lock);
			if (!queued)
				return 0; /* Python chooses */
			continue;
		}
		if (settle) { /* the pass before's last OPENs under way: their answers first */
			while ((q = queue_of(p, job_id, pool)) && q->opening)
				pthread_cond_wait(&p->view_settled, &p->view_lock);
			pthread_mutex_unlock(&p->view_lock);
			continue;
		}
		pthread_mutex_unlock(&p->view_lock);
		if (!o)
			return 0; /* none queued (or no room, or held): Python chooses */
		if (!s)
			continue;
		value_path(p, name, path);
		int fd = open(path, O_RDONLY | O_NOATIME | O_CLOEXEC);
		struct stat st;
		if (fd >= 0 && (fstat(fd, &st) || (uint64_t)st.st_size != size)) {
			close(fd);
			fd = -1;
		}
		atomic_fetch_sub(&s->inflight, 1);
		pthread_mutex_lock(&p->view_lock);
		q = queue_of(p, job_id, pool); /* the job may be gone meanwhile */
		if (fd < 0) { /* culled behind mountd's back, or not the verified file */
			o->seq = 0;
			given_back(p, job_id, q, e);
		} else {
			o->fd = fd;
			view_event(p, job_id, e, VIEW_OPENED, now_ns() - started);
		}
		if (q && !--q->opening) /* the pass's OPENs answered: a later one may go */
			pthread_cond_broadcast(&p->view_settled);
		pthread_mutex_unlock(&p->view_lock);
		if (fd < 0)
			continue;
		/* direct I/O: another job's open of this inode reads other bytes */
		struct fuse_open_out out = {.fh = FH_NATIVE | (uint64_t)(o - p->view_files),
					    .open_flags = FOPEN_DIRECT_IO};
		atomic_fetch_add_explicit(&p->view_opens, 1, memory_order_relaxed);
		reply_on(p->ctl_fd, in->unique, 0, &out, sizeof out);
		return 1;
	}
}

/* The open record of a file handle this file gave, or NULL. */
static struct view_open *open_of(struct plane *p, uint64_t fh)
{
	if (!(fh & FH_NATIVE))
		return NULL;
	uint64_t at = fh & ~FH_NATIVE;
	pthread_mutex_lock(&p->view_lock);
	struct view_open *o = at < p->n_view_files && p->view_files[at].seq && p->view_files[at].fd >= 0
				      ? &p->view_files[at] : NULL;
	pthread_mutex_unlock(&p->view_lock);
	return o;
}

/* A READ of a view file opened here: its item's bytes, from the file held open (an
 * item the store evicts meanwhile is still whole there). Where the scrubber found the
 * item changed since (a withdrawal that waits), EIO: no byte of it is sent after. */
static int view_read(struct plane *p, const struct fuse_in_header *in,
		     const struct fuse_read_in *arg, struct worker *w)
{
	struct view_open *o = open_of(p, arg->fh);
	if (!o)
		return 0;
	if (arg->size > DATA_BUF) { /* more than the connection's max_pages: never sent */
		reply_on(p->ctl_fd, in->unique, EIO, NULL, 0);
		return 1;
	}
	pthread_rwlock_rdlock(&p->lock);
	struct slot *s = o->slot < p->n_slots ? slot_at(p, o->slot) : NULL;
	if (s && memcmp(s->digest, o->digest, PLANE_DIGEST))
		s = NULL; /* its view is gone, and the slot names another item */
	int condemned = s && s->condemned;
	if (s && !condemned)
		atomic_fetch_add(&s->inflight, 1);
	pthread_rwlock_unlock(&p->lock);
	if (condemned) {
		reply_on(p->ctl_fd, in->unique, EIO, NULL, 0);
		return 1;
	}
	uint64_t off = arg->offset, size = o->size;
	uint64_t n = off >= size ? 0 : size - off < arg->size ? size - off : arg->size;
	int filled = n ? file_fill(w, in->unique, o->fd, off, n) : -1;
	if (filled == 0) {
		reply_on(p->ctl_fd, in->unique, EIO, NULL, 0);
	} else {
		atomic_fetch_add_explicit(&p->view_reads, 1, memory_order_relaxed);
		atomic_fetch_add_explicit(&p->view_read_bytes, n, memory_order_relaxed);
		if (n)
			file_send(p, w, p->ctl_fd, in->unique, n, filled);
		else
			reply_on(p->ctl_fd, in->unique, 0, NULL, 0);
	}
	if (s)
		atomic_fetch_sub(&s->inflight, 1);
	return 1;
}

/* Under view_lock: whether Python may have a view file open at inode for pid (then
 * that process's GETATTR of it is Python's: fstat says the size of what it serves). */
static int python_opened(const struct plane *p, uint32_t pid, uint64_t inode)
{
	if (p->py_unrecorded)
		return 1;
	for (size_t i = 0; i < p->n_py_opens; i++)
		if (p->py_opens[i].pid == pid && p->py_opens[i].inode == inode)
			return 1;
	return 0;
}

/* GETATTR of a view file by a process that has none open there: the file's own
 * attributes (its digest's entry), as mountd's ControlFS gives them, never cached by
 * the kernel (it asks before each open, for its permission check). 0 where the inode
 * is not a view file's. */
static int view_path_getattr(struct plane *p, const struct fuse_in_header *in)
{
	struct fuse_attr_out out;
	memset(&out, 0, sizeof out);
	uint32_t node;
	pthread_rwlock_rdlock(&p->lock);
	struct dataset *ds = dataset_of(p, in->nodeid, &node);
	int file = ds && ds->pools && node >= ds->t->n_dirs;
	if (file)
		fill_attr(p, ds, node, &out.attr);
	pthread_rwlock_unlock(&p->lock);
	if (!file)
		return 0;
	atomic_fetch_add_explicit(&p->view_getattrs, 1, memory_order_relaxed);
	reply_on(p->ctl_fd, in->unique, 0, &out, sizeof out);
	return 1;
}

/* GETATTR of a view file by a process that has it open here (fstat): the attributes
 * of the item it serves, as mountd's ControlFS gives them, never cached by the
 * kernel; by a process that has none open, the file's own (view_path_getattr). Any
 * other GETATTR is the connection's process's. */
static int view_getattr(struct plane *p, const struct fuse_in_header *in)
{
	struct fuse_attr_out out;
	memset(&out, 0, sizeof out);
	pthread_mutex_lock(&p->view_lock);
	struct view_open *o = opened_by(p, in->pid, in->nodeid);
	int python = !o && python_opened(p, in->pid, in->nodeid);
	if (o) {
		struct fuse_attr *a = &out.attr;
		a->ino = o->inode;
		a->uid = o->uid;
		a->gid = o->gid;
		int64_t sec = o->time_ns / 1000000000, nsec = o->time_ns % 1000000000;
		if (nsec < 0) {
			sec--;
			nsec += 1000000000;
		}
		a->atime = a->mtime = a->ctime = (uint64_t)sec;
		a->atimensec = a->mtimensec = a->ctimensec = (uint32_t)nsec;
		a->blksize = BLKSIZE;
		a->mode = S_IFREG | 0444;
		a->nlink = 1;
		a->size = o->size;
		a->blocks = (o->size + 511) / 512;
	}
	pthread_mutex_unlock(&p->view_lock);
	if (!o)
		return !python && view_path_getattr(p, in);
	atomic_fetch_add_explicit(&p->view_getattrs, 1, memory_order_relaxed);
	reply_on(p->ctl_fd, in->unique, 0, &out, sizeof out);
	return 1;
}

static int view_release(struct plane *p, const struct fuse_in_header *in,
			const struct fuse_release_in *arg)
{
	struct view_open *o = open_of(p, arg->fh);
	if (!o)
		return 0;
	pthread_mutex_lock(&p->view_lock);
	int fd = o->fd;
	o->fd = -1;
	o->seq = 0;
	pthread_mutex_unlock(&p->view_lock);
	close(fd);
	atomic_fetch_add_explicit(&p->view_releases, 1, memory_order_relaxed);
	reply_on(p->ctl_fd, in->unique, 0, NULL, 0);
	return 1;
}

/* A request for the connection's process, whole, on the socket (a stream: one request
 * at a time). Dropped where the process is gone (the connection soon is). */
static void ctl_forward(struct plane *p, const char *buf, size_t len)
{
	pthread_mutex_lock(&p->fwd_lock);
	for (size_t sent = 0; sent < len;) {
		ssize_t n = send(p->ctl_fwd, buf + sent, len - sent, MSG_NOSIGNAL);
		if (n < 0 && errno == EINTR && !atomic_load(&p->ctl_stopping))
			continue;
		if (n <= 0)
			break;
		sent += (size_t)n;
	}
	pthread_mutex_unlock(&p->fwd_lock);
	atomic_fetch_add_explicit(&p->view_forwarded, 1, memory_order_relaxed);
}

static void ctl_handle(struct plane *p, char *buf, size_t len, struct worker *w)
{
	const struct fuse_in_header *in = (const void *)buf;
	const char *arg = buf + sizeof *in;
	size_t arg_len = len - sizeof *in;
	int done = 0;
	switch (in->opcode) {
	case FUSE_OPEN:
		done = arg_len >= sizeof(struct fuse_open_in) &&
		       view_open(p, in, (const struct fuse_open_in *)arg);
		break;
	case FUSE_READ:
		done = arg_len >= sizeof(struct fuse_read_in) &&
		       view_read(p, in, (const struct fuse_read_in *)arg, w);
		break;
	case FUSE_GETATTR:
		done = view_getattr(p, in);
		break;
	case FUSE_FLUSH:
		/* ENOSYS, as the process's pyfuse3 answers it (no file there has anything to
		 * write back at close): the kernel then sends no FLUSH on this connection,
		 * a request less per view file */
		reply_on(p->ctl_fd, in->unique, ENOSYS, NULL, 0);
		done = 1;
		break;
	case FUSE_RELEASE:
		done = arg_len >= sizeof(struct fuse_release_in) &&
		       view_release(p, in, (const struct fuse_release_in *)arg);
		break;
	case FUSE_IOCTL:
		/* ENOSYS, as libfuse answers it for pyfuse3 (which has no ioctl): the
		 * isatty() of every open() in Python's buffered mode would cost a round
		 * trip to the process */
		reply_on(p->ctl_fd, in->unique, ENOSYS, NULL, 0);
		done = 1;
		break;
	}
	if (!done)
		ctl_forward(p, buf, len);
}

static void *ctl_main(void *arg)
{
	struct plane *p = arg;
	thread_signals();
	struct worker w;
	worker_open(&w);
	while (w.buf && w.data && !atomic_load(&p->ctl_stopping)) {
		ssize_t n = read(p->ctl_fd, w.buf, REQUEST_BUF);
		if (n < 0) {
			if (errno == EINTR || errno == ENOENT || errno == EAGAIN)
				continue;
			/* ENODEV: unmounted; the process serving the rest sees the end too */
			shutdown(p->ctl_fwd, SHUT_RDWR);
			break;
		}
		if ((size_t)n >= sizeof(struct fuse_in_header))
			ctl_handle(p, w.buf, (size_t)n, &w);
	}
	worker_close(&w);
	return NULL;
}

int plane_control_start(struct plane *p, int dev_fd, int fwd_fd, int threads)
{
	if (p->ctl_fd >= 0 || threads < 1) {
		close(dev_fd);
		close(fwd_fd);
		return p->ctl_fd >= 0 ? -EBUSY : -EINVAL;
	}
	p->ctl_fd = dev_fd;
	p->ctl_fwd = fwd_fd;
	int flags = fcntl(dev_fd, F_GETFL);
	int error = flags < 0 || fcntl(dev_fd, F_SETFL, flags & ~O_NONBLOCK) < 0 ||
			    stop_signal_ready() < 0
		    ? -errno : 0;
	if (!error && !(p->ctl_threads = calloc((size_t)threads, sizeof *p->ctl_threads)))
		error = -ENOMEM;
	if (!error) {
		atomic_store(&p->ctl_stopping, 0);
		p->ctl_started = start_threads(p->ctl_threads, threads, ctl_main, p);
		if (p->ctl_started < threads)
			error = -EAGAIN;
	}
	if (error)
		plane_control_stop(p);
	return error;
}

void plane_control_stop(struct plane *p)
{
	if (p->ctl_fd < 0)
		return;
	atomic_store(&p->ctl_stopping, 1);
	pthread_mutex_lock(&p->view_lock); /* OPENs waiting for Python go to it now */
	pthread_cond_broadcast(&p->view_settled);
	pthread_mutex_unlock(&p->view_lock);
	join_threads(p->ctl_threads, p->ctl_started);
	p->ctl_started = 0;
	free(p->ctl_threads);
	p->ctl_threads = NULL;
	close(p->ctl_fd);
	close(p->ctl_fwd);
	p->ctl_fd = p->ctl_fwd = -1;
	pthread_mutex_lock(&p->view_lock); /* the connection's open files went with it */
	p->n_py_opens = 0;
	p->py_unrecorded = 0;
	for (size_t i = 0; i < p->n_view_files; i++) {
		if (p->view_files[i].seq && p->view_files[i].fd >= 0)
			close(p->view_files[i].fd);
		p->view_files[i].seq = 0;
	}
	p->n_view_files = 0;
	pthread_mutex_unlock(&p->view_lock);
}
