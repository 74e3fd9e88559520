/* mountd.native._dataplane: the native data plane (plane.h) as a Python object, and
 * its hook into pyfuse3's libfuse session (fuse_session_custom_io). Once attached, the
 * plane's threads own every read of the session's /dev/fuse descriptor: libfuse (and
 * so pyfuse3) reads the requests they leave for it from the plane's queue, through the
 * session's custom I/O, and waits on the plane's eventfd, which the patched pyfuse3
 * takes as its session descriptor (mountd/patches). Replies and notifications from
 * Python go to the /dev/fuse descriptor as before. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define FUSE_USE_VERSION 34
#include <errno.h>
#include <fcntl.h>
#include <fuse_lowlevel.h>
#include <linux/fuse.h>
#include <sys/socket.h>
#include <unistd.h>

#include "plane.h"

#define DRAIN_MAX 65536

typedef struct {
	PyObject_HEAD
	struct plane *plane;
	int attached; /* the session's custom I/O is this plane's (one per process) */
	int closed;   /* its /dev/fuse descriptor closed (stopped) */
} PlaneObject;

static struct plane *session_plane; /* the plane libfuse's custom I/O reads from */

static ssize_t io_read(int fd, void *buf, size_t len, void *userdata)
{
	(void)fd;
	(void)userdata;
	ssize_t n = plane_take(session_plane, buf, len);
	if (n < 0 && errno == EAGAIN)
		errno = EINTR; /* pyfuse3 waits again on EINTR (it gives up on EAGAIN) */
	return n;
}

static ssize_t io_writev(int fd, struct iovec *iov, int count, void *userdata)
{
	(void)fd;
	(void)userdata;
	return plane_write(session_plane, iov, count);
}

static ssize_t io_splice_send(int fdin, off_t *offin, int fdout, off_t *offout, size_t len,
			      unsigned int flags, void *userdata)
{
	(void)fdout;
	(void)userdata;
	return splice(fdin, offin, plane_dev_fd(session_plane), offout, len, flags);
}

/* ---- the process serving ROOT/.quiver, where mountd's plane answers view files:
 * its libfuse reads the requests the plane forwards from a socket, and replies to the
 * connection's /dev/fuse descriptor (shared with mountd: one open file) ---- */
static int forward_sock = -1, forward_dev = -1;

static ssize_t forward_read(int fd, void *buf, size_t len, void *userdata)
{
	(void)fd;
	(void)userdata;
	struct fuse_in_header in;
	ssize_t n = recv(forward_sock, &in, sizeof in, MSG_PEEK | MSG_DONTWAIT);
	if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
		errno = EINTR; /* pyfuse3 waits again */
		return -1;
	}
	if (n < (ssize_t)sizeof in) {
		/* 0: mountd closed it (the connection ended); a part of a header: the rest
		 * comes with it (one send), wait for it */
		errno = n == 0 || n < 0 ? ENODEV : EINTR;
		return -1;
	}
	if (in.len < sizeof in || in.len > len) { /* not a request: the stream is broken */
		errno = ENODEV;
		return -1;
	}
	n = recv(forward_sock, buf, in.len, MSG_WAITALL);
	if (n != (ssize_t)in.len) {
		errno = ENODEV;
		return -1;
	}
	return n;
}

static ssize_t forward_writev(int fd, struct iovec *iov, int count, void *userdata)
{
	(void)fd;
	(void)userdata;
	return writev(forward_dev, iov, count);
}

static ssize_t forward_splice_send(int fdin, off_t *offin, int fdout, off_t *offout,
				   size_t len, unsigned int flags, void *userdata)
{
	(void)fdout;
	(void)userdata;
	return splice(fdin, offin, forward_dev, offout, len, flags);
}

static PyObject *forward_session(PyObject *module, PyObject *args)
{
	(void)module;
	PyObject *address;
	int sock;
	if (!PyArg_ParseTuple(args, "Oi", &address, &sock))
		return NULL;
	struct fuse_session *se = PyLong_AsVoidPtr(address);
	if (!se)
		return PyErr_Occurred() ? NULL : PyErr_Format(PyExc_ValueError, "no session");
	if (forward_sock >= 0)
		return PyErr_Format(PyExc_RuntimeError, "already forwarding");
	const struct fuse_custom_io io = {.read = forward_read, .writev = forward_writev,
					  .splice_send = forward_splice_send};
	int dev = fuse_session_fd(se);
	if (fuse_session_custom_io(se, &io, sock))
		return PyErr_Format(PyExc_OSError, "fuse_session_custom_io failed");
	forward_sock = sock;
	forward_dev = dev;
	return PyLong_FromLong(dev);
}

static PyObject *forward_close(PyObject *module, PyObject *unused)
{
	(void)module;
	(void)unused;
	if (forward_dev >= 0) /* before the unmount, as libfuse closes its own */
		close(forward_dev);
	forward_dev = -1;
	Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
	{"forward_session", forward_session, METH_VARARGS,
	 "forward_session(session_address, sock) -> the session's /dev/fuse descriptor, "
	 "which it replies to; it reads its requests from the stream socket sock (mountd's "
	 "plane forwards them) from now on"},
	{"forward_close", forward_close, METH_NOARGS,
	 "forward_close(): close the session's /dev/fuse descriptor (before the unmount)"},
	{NULL, NULL, 0, NULL},
};

static int Plane_init(PlaneObject *self, PyObject *args, PyObject *kwds)
{
	static char *kwlist[] = {"store_dir", "threads", "root_timeout", "timeout", NULL};
	PyObject *dir;
	int threads;
	double root_timeout, timeout;
	if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&idd", kwlist, PyUnicode_FSConverter,
					 &dir, &threads, &root_timeout, &timeout))
		return -1;
	if (self->plane) {
		Py_DECREF(dir);
		PyErr_SetString(PyExc_RuntimeError, "plane already made");
		return -1;
	}
	self->plane = plane_new(PyBytes_AS_STRING(dir), threads, root_timeout, timeout);
	Py_DECREF(dir);
	if (!self->plane) {
		PyErr_SetFromErrno(PyExc_OSError);
		return -1;
	}
	return 0;
}

static void Plane_dealloc(PlaneObject *self)
{
	if (self->plane && !self->attached) /* an attached plane lives as long as its session */
		plane_free(self->plane);
	Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Plane_attach(PlaneObject *self, PyObject *arg)
{
	struct fuse_session *se = PyLong_AsVoidPtr(arg);
	if (!se)
		return PyErr_Occurred() ? NULL : PyErr_Format(PyExc_ValueError, "no session");
	if (session_plane)
		return PyErr_Format(PyExc_RuntimeError, "a plane is already attached");
	int error = plane_start(self->plane, fuse_session_fd(se));
	if (error) {
		errno = -error;
		return PyErr_SetFromErrno(PyExc_OSError);
	}
	session_plane = self->plane;
	const struct fuse_custom_io io = {
		.read = io_read, .writev = io_writev, .splice_send = io_splice_send};
	/* libfuse now reads from the plane and waits on its eventfd (closing it at the
	 * session's end); the /dev/fuse descriptor is the plane's to close (stop). */
	if (fuse_session_custom_io(se, &io, plane_event_fd(self->plane))) {
		plane_stop(self->plane);
		session_plane = NULL;
		return PyErr_Format(PyExc_OSError, "fuse_session_custom_io failed");
	}
	self->attached = 1;
	Py_RETURN_NONE;
}

static PyObject *Plane_stop(PlaneObject *self, PyObject *unused)
{
	(void)unused;
	Py_BEGIN_ALLOW_THREADS
	plane_control_stop(self->plane);
	plane_stop(self->plane);
	Py_END_ALLOW_THREADS
	if (self->attached && !self->closed) {
		/* Closed before the unmount, as libfuse does with its own descriptor: a
		 * synchronous unmount could otherwise wait for a reply nobody reads. */
		close(plane_dev_fd(self->plane));
		self->closed = 1;
	}
	Py_RETURN_NONE;
}

static int buffer_of(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, Py_ssize_t count,
		     const char *what)
{
	if (PyObject_GetBuffer(obj, view, PyBUF_SIMPLE))
		return -1;
	if (view->len != itemsize * count) {
		PyErr_Format(PyExc_ValueError, "%s: %zd bytes, expected %zd", what, view->len,
			     itemsize * count);
		PyBuffer_Release(view);
		return -1;
	}
	return 0;
}

/* A tree's buffers, held while the plane copies them. */
struct tree_buffers {
	Py_buffer parents, names, ends, sizes, digests;
	int held; /* how many of them, in that order */
};

static void tree_buffers_release(struct tree_buffers *b)
{
	Py_buffer *all[] = {&b->parents, &b->names, &b->ends, &b->sizes, &b->digests};
	for (int i = 0; i < b->held; i++)
		PyBuffer_Release(all[i]);
	b->held = 0;
}

/* `tree`, a tuple (n_dirs, n_files, parents, names, name_ends, sizes, digests), as the
 * plane's struct; 0, or -1 with an exception set (its buffers released). */
static int tree_from(PyObject *tree, struct plane_tree *out, struct tree_buffers *b)
{
	PyObject *o[5];
	b->held = 0;
	if (!PyArg_ParseTuple(tree, "IIOOOOO", &out->n_dirs, &out->n_files, &o[0], &o[1], &o[2],
			      &o[3], &o[4]))
		return -1;
	Py_ssize_t n_nodes = (Py_ssize_t)out->n_dirs + out->n_files;
	if (buffer_of(o[0], &b->parents, 4, n_nodes, "parents"))
		return -1;
	b->held = 1;
	if (PyObject_GetBuffer(o[1], &b->names, PyBUF_SIMPLE))
		goto fail;
	b->held = 2;
	if (buffer_of(o[2], &b->ends, 4, n_nodes, "name_ends"))
		goto fail;
	b->held = 3;
	if (buffer_of(o[3], &b->sizes, 8, out->n_files, "sizes"))
		goto fail;
	b->held = 4;
	if (buffer_of(o[4], &b->digests, PLANE_DIGEST, out->n_files, "digests"))
		goto fail;
	b->held = 5;
	if (!n_nodes || ((const uint32_t *)b->ends.buf)[n_nodes - 1] > (size_t)b->names.len) {
		PyErr_SetString(PyExc_ValueError, "name_ends: past the names");
		goto fail;
	}
	out->parents = b->parents.buf;
	out->names = b->names.buf;
	out->name_ends = b->ends.buf;
	out->sizes = b->sizes.buf;
	out->digests = b->digests.buf;
	return 0;
fail:
	tree_buffers_release(b);
	return -1;
}

static PyObject *Plane_add_dataset(PlaneObject *self, PyObject *args)
{
	unsigned long long base;
	unsigned int uid, gid;
	long long time_ns;
	Py_buffer identity, pools = {.buf = NULL, .len = 0};
	PyObject *tree, *pools_arg = Py_None;
	if (!PyArg_ParseTuple(args, "Ky*IILO|O", &base, &identity, &uid, &gid, &time_ns, &tree,
			      &pools_arg))
		return NULL;
	if (pools_arg != Py_None) {
		if (PyObject_GetBuffer(pools_arg, &pools, PyBUF_SIMPLE)) {
			PyBuffer_Release(&identity);
			return NULL;
		}
		if (pools.len % 4) {
			PyBuffer_Release(&pools);
			PyBuffer_Release(&identity);
			return PyErr_Format(PyExc_ValueError, "add_dataset: pools of 4-byte items");
		}
	}
	struct plane_tree in;
	struct tree_buffers buffers = {.held = 0};
	int result = -EINVAL;
	if (identity.len != PLANE_DIGEST) {
		PyBuffer_Release(&identity);
		if (pools.buf)
			PyBuffer_Release(&pools);
		return PyErr_Format(PyExc_ValueError, "add_dataset: a 32-byte identity is needed");
	}
	if (tree != Py_None && tree_from(tree, &in, &buffers)) {
		PyBuffer_Release(&identity);
		if (pools.buf)
			PyBuffer_Release(&pools);
		return NULL;
	}
	Py_BEGIN_ALLOW_THREADS
	result = plane_add_dataset(self->plane, base, identity.buf, uid, gid, time_ns,
				   tree == Py_None ? NULL : &in,
				   pools_arg == Py_None ? NULL : pools.buf,
				   (uint32_t)(pools.len / 4));
	Py_END_ALLOW_THREADS
	tree_buffers_release(&buffers);
	PyBuffer_Release(&identity);
	if (pools.buf)
		PyBuffer_Release(&pools);
	if (result) {
		errno = -result;
		return PyErr_SetFromErrno(PyExc_OSError);
	}
	Py_RETURN_NONE;
}

static PyObject *Plane_has_tree(PlaneObject *self, PyObject *arg)
{
	Py_buffer identity;
	if (PyObject_GetBuffer(arg, &identity, PyBUF_SIMPLE))
		return NULL;
	int found = identity.len == PLANE_DIGEST && plane_has_tree(self->plane, identity.buf);
	PyBuffer_Release(&identity);
	return PyBool_FromLong(found);
}

static PyObject *Plane_remove_dataset(PlaneObject *self, PyObject *arg)
{
	unsigned long long base = PyLong_AsUnsignedLongLong(arg);
	if (PyErr_Occurred())
		return NULL;
	int result;
	Py_BEGIN_ALLOW_THREADS
	result = plane_remove_dataset(self->plane, base);
	Py_END_ALLOW_THREADS
	return PyBool_FromLong(result == 0);
}

static PyObject *Plane_suspend(PlaneObject *self, PyObject *args)
{
	unsigned long long base;
	int suspended;
	if (!PyArg_ParseTuple(args, "Kp", &base, &suspended))
		return NULL;
	return PyBool_FromLong(plane_suspend_dataset(self->plane, base, suspended) == 0);
}

static PyObject *Plane_serve(PlaneObject *self, PyObject *args)
{
	Py_buffer digest, name;
	if (!PyArg_ParseTuple(args, "y*y*", &digest, &name))
		return NULL;
	int result = -EINVAL;
	if (digest.len == PLANE_DIGEST && name.len == PLANE_NAME)
		result = plane_serve(self->plane, digest.buf, name.buf);
	PyBuffer_Release(&digest);
	PyBuffer_Release(&name);
	if (result < 0)
		return PyErr_Format(PyExc_ValueError, "serve: a 32-byte digest and a value "
				    "file's 32 hex digits are needed");
	return PyBool_FromLong(result);
}

static PyObject *Plane_withdraw(PlaneObject *self, PyObject *args)
{
	Py_buffer digest;
	int wait;
	if (!PyArg_ParseTuple(args, "y*p", &digest, &wait))
		return NULL;
	if (digest.len != PLANE_DIGEST) {
		PyBuffer_Release(&digest);
		return PyErr_Format(PyExc_ValueError, "withdraw: a 32-byte digest is needed");
	}
	Py_BEGIN_ALLOW_THREADS
	plane_withdraw(self->plane, digest.buf, wait);
	Py_END_ALLOW_THREADS
	PyBuffer_Release(&digest);
	Py_RETURN_NONE;
}

static PyObject *Plane_drain_hits(PlaneObject *self, PyObject *unused)
{
	(void)unused;
	struct plane_hit *hits = malloc(DRAIN_MAX * sizeof *hits);
	if (!hits)
		return PyErr_NoMemory();
	size_t n = plane_drain_hits(self->plane, hits, DRAIN_MAX);
	PyObject *list = PyList_New((Py_ssize_t)n);
	for (size_t i = 0; list && i < n; i++) {
		PyObject *hit = Py_BuildValue("(Kd)", hits[i].inode, hits[i].ns / 1e9);
		if (!hit)
			Py_CLEAR(list);
		else
			PyList_SET_ITEM(list, (Py_ssize_t)i, hit);
	}
	free(hits);
	return list;
}

static PyObject *Plane_counters(PlaneObject *self, PyObject *unused)
{
	(void)unused;
	struct plane_counters c;
	plane_counters(self->plane, &c);
	return Py_BuildValue("{sKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsK}", "lookups",
			     c.lookups, "getattrs", c.getattrs, "reads", c.reads, "read_bytes",
			     c.read_bytes, "copied", c.copied, "hits", c.hits, "forwarded",
			     c.forwarded, "fallbacks", c.fallbacks,
			     "hits_dropped", c.hits_dropped, "forgets", c.forgets, "opens",
			     c.opens, "releases", c.releases, "backing_failures",
			     c.backing_failures, "store_drops", c.store_drops, "view_opens",
			     c.view_opens, "view_reads", c.view_reads, "view_read_bytes",
			     c.view_read_bytes, "view_getattrs", c.view_getattrs,
			     "view_releases", c.view_releases, "view_returned", c.view_returned,
			     "view_forwarded", c.view_forwarded, "view_events_dropped",
			     c.view_events_dropped, "view_waits", c.view_waits, "view_declined",
			     c.view_declined);
}

static PyObject *Plane_set_passthrough(PlaneObject *self, PyObject *arg)
{
	int on = PyObject_IsTrue(arg);
	if (on < 0)
		return NULL;
	plane_set_passthrough(self->plane, on);
	Py_RETURN_NONE;
}

static PyObject *Plane_passthrough_offered(PlaneObject *self, PyObject *unused)
{
	(void)unused;
	return PyBool_FromLong(plane_passthrough_offered(self->plane));
}

static PyObject *errno_result(int result)
{
	if (result) {
		errno = -result;
		return PyErr_SetFromErrno(PyExc_OSError);
	}
	Py_RETURN_NONE;
}

static PyObject *Plane_control_start(PlaneObject *self, PyObject *args)
{
	int dev_fd, fwd_fd, threads;
	if (!PyArg_ParseTuple(args, "iii", &dev_fd, &fwd_fd, &threads))
		return NULL;
	return errno_result(plane_control_start(self->plane, dev_fd, fwd_fd, threads));
}

static PyObject *Plane_control_stop(PlaneObject *self, PyObject *unused)
{
	(void)unused;
	Py_BEGIN_ALLOW_THREADS
	plane_control_stop(self->plane);
	Py_END_ALLOW_THREADS
	Py_RETURN_NONE;
}

static PyObject *Plane_view_job(PlaneObject *self, PyObject *args)
{
	unsigned int id, uid;
	unsigned long long base;
	if (!PyArg_ParseTuple(args, "IKI", &id, &base, &uid))
		return NULL;
	return errno_result(plane_view_job(self->plane, id, base, uid));
}

static PyObject *Plane_view_forget(PlaneObject *self, PyObject *arg)
{
	unsigned long id = PyLong_AsUnsignedLong(arg);
	if (PyErr_Occurred())
		return NULL;
	plane_view_forget(self->plane, (uint32_t)id);
	Py_RETURN_NONE;
}

static PyObject *Plane_view_pid(PlaneObject *self, PyObject *args)
{
	unsigned int id, pid;
	int pgid;
	if (!PyArg_ParseTuple(args, "IIi", &id, &pid, &pgid))
		return NULL;
	return errno_result(plane_view_pid(self->plane, id, pid, pgid));
}

static PyObject *Plane_view_push(PlaneObject *self, PyObject *args)
{
	unsigned int id, pool, pass;
	Py_buffer items;
	if (!PyArg_ParseTuple(args, "IIy*I", &id, &pool, &items, &pass))
		return NULL;
	int result = -EINVAL;
	if (items.len % 4 == 0)
		result = plane_view_push(self->plane, id, pool, items.buf, (size_t)items.len / 4,
					 pass);
	PyBuffer_Release(&items);
	return errno_result(result);
}

static PyObject *Plane_view_pass(PlaneObject *self, PyObject *args)
{
	unsigned int id, pool, pass;
	if (!PyArg_ParseTuple(args, "III", &id, &pool, &pass))
		return NULL;
	plane_view_pass(self->plane, id, pool, pass);
	Py_RETURN_NONE;
}

static PyObject *Plane_view_decline(PlaneObject *self, PyObject *args)
{
	unsigned int id, pool;
	if (!PyArg_ParseTuple(args, "II", &id, &pool))
		return NULL;
	plane_view_decline(self->plane, id, pool);
	Py_RETURN_NONE;
}

static PyObject *Plane_view_waiting(PlaneObject *self, PyObject *args)
{
	unsigned int id, pool;
	if (!PyArg_ParseTuple(args, "II", &id, &pool))
		return NULL;
	return PyLong_FromUnsignedLong(plane_view_waiting(self->plane, id, pool));
}

static PyObject *Plane_view_opened(PlaneObject *self, PyObject *args)
{
	unsigned int pid;
	unsigned long long inode;
	if (!PyArg_ParseTuple(args, "IK", &pid, &inode))
		return NULL;
	uint32_t item;
	if (plane_view_opened(self->plane, pid, inode, &item))
		Py_RETURN_NONE;
	return PyLong_FromUnsignedLong(item);
}

static PyObject *Plane_view_drain(PlaneObject *self, PyObject *unused)
{
	(void)unused;
	struct plane_view_event *events = malloc(DRAIN_MAX * sizeof *events);
	if (!events)
		return PyErr_NoMemory();
	size_t n = plane_view_drain(self->plane, events, DRAIN_MAX);
	PyObject *list = PyList_New((Py_ssize_t)n);
	for (size_t i = 0; list && i < n; i++) {
		PyObject *event = Py_BuildValue("(IIIdI)", events[i].job, events[i].item,
						events[i].kind, events[i].ns / 1e9, events[i].pass);
		if (!event)
			Py_CLEAR(list);
		else
			PyList_SET_ITEM(list, (Py_ssize_t)i, event);
	}
	free(events);
	return list;
}

static PyObject *Plane_view_python_open(PlaneObject *self, PyObject *args)
{
	unsigned int pid;
	unsigned long long inode;
	int delta;
	if (!PyArg_ParseTuple(args, "IKi", &pid, &inode, &delta))
		return NULL;
	return PyBool_FromLong(plane_view_python_open(self->plane, pid, inode, delta) == 0);
}

static PyObject *Plane_view_take(PlaneObject *self, PyObject *args)
{
	unsigned int id, pool;
	if (!PyArg_ParseTuple(args, "II", &id, &pool))
		return NULL;
	uint32_t item, pass;
	if (plane_view_take(self->plane, id, pool, &item, &pass))
		Py_RETURN_NONE;
	return Py_BuildValue("(II)", item, pass);
}

static PyObject *Plane_view_wake_fd(PlaneObject *self, PyObject *unused)
{
	(void)unused;
	return PyLong_FromLong(plane_view_wake_fd(self->plane));
}

static PyMethodDef Plane_methods[] = {
	{"attach", (PyCFunction)Plane_attach, METH_O,
	 "attach(session_address): start the threads on the session's /dev/fuse descriptor, "
	 "and give libfuse the plane's queue to read from"},
	{"stop", (PyCFunction)Plane_stop, METH_NOARGS,
	 "stop(): join the threads; an attached plane closes the /dev/fuse descriptor"},
	{"add_dataset", (PyCFunction)Plane_add_dataset, METH_VARARGS,
	 "add_dataset(base, identity, uid, gid, time_ns, tree): a dataset from the digest "
	 "`identity` (32 bytes), sharing the tree held for it, else `tree`: (n_dirs, n_files, "
	 "parents, names, name_ends, sizes, digests), see plane.h"},
	{"has_tree", (PyCFunction)Plane_has_tree, METH_O,
	 "has_tree(identity) -> whether a tree is held for that digest"},
	{"remove_dataset", (PyCFunction)Plane_remove_dataset, METH_O,
	 "remove_dataset(base) -> whether it was there"},
	{"suspend", (PyCFunction)Plane_suspend, METH_VARARGS,
	 "suspend(base, suspended): while suspended its READs go to Python"},
	{"serve", (PyCFunction)Plane_serve, METH_VARARGS,
	 "serve(digest, name) -> whether a registered dataset names it"},
	{"withdraw", (PyCFunction)Plane_withdraw, METH_VARARGS,
	 "withdraw(digest, wait): serve it no more; with wait, return once no READ or OPEN "
	 "of it is in flight"},
	{"drain_hits", (PyCFunction)Plane_drain_hits, METH_NOARGS,
	 "drain_hits() -> [(inode, seconds)] of the files served since the last call"},
	{"counters", (PyCFunction)Plane_counters, METH_NOARGS, "counters() -> dict"},
	{"set_passthrough", (PyCFunction)Plane_set_passthrough, METH_O,
	 "set_passthrough(on): answer OPENs of served items with their value files as "
	 "backing files (before INIT is answered: its reply then asks for passthrough)"},
	{"passthrough_offered", (PyCFunction)Plane_passthrough_offered, METH_NOARGS,
	 "passthrough_offered() -> whether the kernel's INIT offered passthrough"},
	{"control_start", (PyCFunction)Plane_control_start, METH_VARARGS,
	 "control_start(dev_fd, fwd_fd, threads): serve ROOT/.quiver's connection's view "
	 "files, forwarding the rest to the socket fwd_fd (both descriptors are the "
	 "plane's from now on)"},
	{"control_stop", (PyCFunction)Plane_control_stop, METH_NOARGS,
	 "control_stop(): join those threads, close their descriptors and open files"},
	{"view_job", (PyCFunction)Plane_view_job, METH_VARARGS,
	 "view_job(id, base, uid): a job of the view at base, for uid"},
	{"view_forget", (PyCFunction)Plane_view_forget, METH_O,
	 "view_forget(id): the job, its queues and processes forgotten"},
	{"view_pid", (PyCFunction)Plane_view_pid, METH_VARARGS,
	 "view_pid(id, pid, pgid): pid reads for job id while in process group pgid"},
	{"view_push", (PyCFunction)Plane_view_push, METH_VARARGS,
	 "view_push(id, pool, items, pass): queue items (uint32 entry indexes of that pool) "
	 "handed out in the job's pass number `pass` over it"},
	{"view_pass", (PyCFunction)Plane_view_pass, METH_VARARGS,
	 "view_pass(id, pool, pass): the job's pass number `pass` over pool has begun"},
	{"view_opened", (PyCFunction)Plane_view_opened, METH_VARARGS,
	 "view_opened(pid, inode) -> the item pid's latest open here at inode serves, or "
	 "None"},
	{"view_python_open", (PyCFunction)Plane_view_python_open, METH_VARARGS,
	 "view_python_open(pid, inode, delta) -> whether recorded: Python opened (1) or "
	 "released (-1 recorded, -2 not) a view file for pid at inode"},
	{"view_take", (PyCFunction)Plane_view_take, METH_VARARGS,
	 "view_take(id, pool) -> (item, pass): the next item queued for that job and pool, "
	 "taken back, and the pass it was queued in; or None"},
	{"view_wake_fd", (PyCFunction)Plane_view_wake_fd, METH_NOARGS,
	 "view_wake_fd() -> an eventfd, readable once a queue runs low or an item is given "
	 "back (read it, then drain)"},
	{"view_drain", (PyCFunction)Plane_view_drain, METH_NOARGS,
	 "view_drain() -> [(job, item, kind, seconds, pass)] since the last call (kind 0: "
	 "opened, 1: given back, 2: an OPEN waits on the empty queue of pool `item`)"},
	{"view_decline", (PyCFunction)Plane_view_decline, METH_VARARGS,
	 "view_decline(id, pool): an OPEN waiting on that queue goes to Python"},
	{"view_waiting", (PyCFunction)Plane_view_waiting, METH_VARARGS,
	 "view_waiting(id, pool) -> n: OPENs waiting on that queue, not declined"},
	{NULL, NULL, 0, NULL},
};

static PyTypeObject PlaneType = {
	PyVarObject_HEAD_INIT(NULL, 0).tp_name = "mountd.native._dataplane.Plane",
	.tp_basicsize = sizeof(PlaneObject),
	.tp_flags = Py_TPFLAGS_DEFAULT,
	.tp_doc = "The native data plane of the datasets' FUSE connection",
	.tp_new = PyType_GenericNew,
	.tp_init = (initproc)Plane_init,
	.tp_dealloc = (destructor)Plane_dealloc,
	.tp_methods = Plane_methods,
};

static struct PyModuleDef module = {
	PyModuleDef_HEAD_INIT, .m_name = "mountd.native._dataplane",
	.m_doc = "The native data plane (mountd/native/plane.h)", .m_size = -1,
	.m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__dataplane(void)
{
	if (PyType_Ready(&PlaneType) < 0)
		return NULL;
	PyObject *m = PyModule_Create(&module);
	if (!m)
		return NULL;
	Py_INCREF(&PlaneType);
	if (PyModule_AddObject(m, "Plane", (PyObject *)&PlaneType) < 0) {
		Py_DECREF(&PlaneType);
		Py_DECREF(m);
		return NULL;
	}
	return m;
}
