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
	Py_buffer identity;
	PyObject *tree;
	if (!PyArg_ParseTuple(args, "Ky*IILO", &base, &identity, &uid, &gid, &time_ns, &tree))
		return NULL;
	struct plane_tree in;
	struct tree_buffers buffers = {.held = 0};
	int result = -EINVAL;
	if (identity.len != PLANE_DIGEST) {
		PyBuffer_Release(&identity);
		return PyErr_Format(PyExc_ValueError, "add_dataset: a 32-byte identity is needed");
	}
	if (tree != Py_None && tree_from(tree, &in, &buffers)) {
		PyBuffer_Release(&identity);
		return NULL;
	}
	Py_BEGIN_ALLOW_THREADS
	result = plane_add_dataset(self->plane, base, identity.buf, uid, gid, time_ns,
				   tree == Py_None ? NULL : &in);
	Py_END_ALLOW_THREADS
	tree_buffers_release(&buffers);
	PyBuffer_Release(&identity);
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
	return Py_BuildValue("{sKsKsKsKsKsKsKsKsKsKsKsKsKsK}", "lookups", c.lookups, "getattrs",
			     c.getattrs, "reads", c.reads, "read_bytes", c.read_bytes, "copied",
			     c.copied, "hits", c.hits, "forwarded", c.forwarded, "fallbacks",
			     c.fallbacks,
			     "hits_dropped", c.hits_dropped, "forgets", c.forgets, "opens",
			     c.opens, "releases", c.releases, "backing_failures",
			     c.backing_failures, "store_drops", c.store_drops);
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
