/* s3ckpt.transfer._gather: one bytes object from many buffers, copied with the GIL
 * released once.
 *
 * A multipart part packed from small items is a join of their bytes. bytes.join copies
 * with the GIL held, and a copy per piece through ctypes.memmove releases and retakes the
 * GIL once per piece; in thread mode each retake waits for the training loop to let the
 * GIL go and then makes the loop wait (docs/decisions/0006-part-sizes.md,
 * docs/decisions/0008-thread-mode-gil.md). Here the buffers are taken with the GIL, then
 * copied in one stretch without it. No library offers a gather copy into a new bytes
 * object that releases the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

static void release_all(Py_buffer *views, Py_ssize_t count) {
    for (Py_ssize_t i = 0; i < count; i++) {
        PyBuffer_Release(&views[i]);
    }
    PyMem_Free(views);
}

static PyObject *join(PyObject *self, PyObject *pieces) {
    PyObject *sequence = PySequence_Fast(pieces, "join() takes a sequence of buffers");
    if (sequence == NULL) {
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(sequence);
    Py_buffer *views = PyMem_Calloc(count > 0 ? count : 1, sizeof(Py_buffer));
    if (views == NULL) {
        Py_DECREF(sequence);
        return PyErr_NoMemory();
    }
    Py_ssize_t taken = 0, total = 0;
    PyObject **items = PySequence_Fast_ITEMS(sequence);
    for (; taken < count; taken++) {
        if (PyObject_GetBuffer(items[taken], &views[taken], PyBUF_C_CONTIGUOUS) < 0) {
            release_all(views, taken);
            Py_DECREF(sequence);
            return NULL;
        }
        total += views[taken].len;
    }
    PyObject *joined = PyBytes_FromStringAndSize(NULL, total);
    if (joined != NULL) {
        char *at = PyBytes_AS_STRING(joined);
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < count; i++) {
            memcpy(at, views[i].buf, (size_t)views[i].len);
            at += views[i].len;
        }
        Py_END_ALLOW_THREADS
    }
    release_all(views, count);
    Py_DECREF(sequence);
    return joined;
}

static PyMethodDef methods[] = {
    {"join", join, METH_O,
     "join(pieces) -> bytes: the pieces' bytes one after another, copied without the GIL."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_gather",
    "One bytes object from many buffers, copied with the GIL released once.", -1, methods,
};

PyMODINIT_FUNC PyInit__gather(void) { return PyModule_Create(&module); }
