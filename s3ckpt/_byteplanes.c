/*
 * Byte planes of fixed-size elements, in one pass and without the GIL.
 *
 * split(data, itemsize, out): plane p (byte p of every element) goes to
 *     out[p*n : (p+1)*n], where n = len(data) / itemsize.
 * merge(planes, out): the inverse; planes is a sequence of itemsize buffers of n bytes.
 *
 * numpy needs two or more passes over memory for either direction (a strided gather per
 * plane, or a shift and an OR for 16-bit words); these loops read and write every byte
 * once, and the common element sizes (2 and 4 bytes) are written so that compilers
 * vectorize them. s3ckpt.byteplanes falls back to numpy where this module is not built.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_ITEMSIZE 16

/* Called with a constant itemsize, so that the inner loop unrolls and the outer one
 * vectorizes; the generic call handles the other sizes. */
static inline void split_planes(const uint8_t *restrict data, uint8_t *restrict out,
                                Py_ssize_t n, Py_ssize_t itemsize) {
    for (Py_ssize_t i = 0; i < n; i++)
        for (Py_ssize_t p = 0; p < itemsize; p++) out[p * n + i] = data[i * itemsize + p];
}

static inline void merge_planes(const uint8_t *const *planes, uint8_t *restrict out,
                                Py_ssize_t n, Py_ssize_t itemsize) {
    for (Py_ssize_t i = 0; i < n; i++)
        for (Py_ssize_t p = 0; p < itemsize; p++) out[i * itemsize + p] = planes[p][i];
}

static void split_any(const uint8_t *data, uint8_t *out, Py_ssize_t n, Py_ssize_t itemsize) {
    switch (itemsize) {
    case 2: split_planes(data, out, n, 2); break;
    case 4: split_planes(data, out, n, 4); break;
    case 8: split_planes(data, out, n, 8); break;
    default: split_planes(data, out, n, itemsize);
    }
}

static void merge_any(const uint8_t *const *planes, uint8_t *out, Py_ssize_t n,
                      Py_ssize_t itemsize) {
    switch (itemsize) {
    case 2: merge_planes(planes, out, n, 2); break;
    case 4: merge_planes(planes, out, n, 4); break;
    case 8: merge_planes(planes, out, n, 8); break;
    default: merge_planes(planes, out, n, itemsize);
    }
}

static PyObject *split(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer data, out;
    Py_ssize_t itemsize;
    if (!PyArg_ParseTuple(args, "y*nw*", &data, &itemsize, &out)) return NULL;
    PyObject *result = NULL;
    if (itemsize < 1 || itemsize > MAX_ITEMSIZE || data.len % itemsize) {
        PyErr_Format(PyExc_ValueError, "%zd bytes are not whole elements of %zd bytes (1 to %d)",
                     data.len, itemsize, MAX_ITEMSIZE);
    } else if (out.len != data.len) {
        PyErr_Format(PyExc_ValueError, "output has %zd bytes, expected %zd", out.len, data.len);
    } else {
        const uint8_t *src = data.buf;
        uint8_t *dst = out.buf;
        Py_ssize_t n = data.len / itemsize;
        Py_BEGIN_ALLOW_THREADS
        split_any(src, dst, n, itemsize);
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    return result;
}

static PyObject *merge(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *sequence;
    Py_buffer out;
    if (!PyArg_ParseTuple(args, "Ow*", &sequence, &out)) return NULL;
    PyObject *planes_seq = PySequence_Fast(sequence, "planes must be a sequence of buffers");
    if (planes_seq == NULL) {
        PyBuffer_Release(&out);
        return NULL;
    }
    Py_ssize_t itemsize = PySequence_Fast_GET_SIZE(planes_seq);
    Py_buffer views[MAX_ITEMSIZE];
    const uint8_t *planes[MAX_ITEMSIZE];
    Py_ssize_t held = 0;
    PyObject *result = NULL;
    if (itemsize < 1 || itemsize > MAX_ITEMSIZE || out.len % itemsize) {
        PyErr_Format(PyExc_ValueError, "%zd planes cannot fill %zd bytes (1 to %d planes)",
                     itemsize, out.len, MAX_ITEMSIZE);
        goto done;
    }
    Py_ssize_t n = out.len / itemsize;
    for (; held < itemsize; held++) {
        PyObject *item = PySequence_Fast_GET_ITEM(planes_seq, held);
        if (PyObject_GetBuffer(item, &views[held], PyBUF_SIMPLE) < 0) goto done;
        if (views[held].len != n) {
            PyErr_Format(PyExc_ValueError, "plane %zd has %zd bytes, expected %zd", held,
                         views[held].len, n);
            held++;
            goto done;
        }
        planes[held] = views[held].buf;
    }
    uint8_t *dst = out.buf;
    Py_BEGIN_ALLOW_THREADS
    merge_any(planes, dst, n, itemsize);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    for (Py_ssize_t i = 0; i < held; i++) PyBuffer_Release(&views[i]);
    Py_DECREF(planes_seq);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"split", split, METH_VARARGS,
     "split(data, itemsize, out): byte p of every element to out[p*n:(p+1)*n]."},
    {"merge", merge, METH_VARARGS,
     "merge(planes, out): the inverse of split; planes holds itemsize buffers of n bytes."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_byteplanes",
    "Byte planes of fixed-size elements, split and merged in one pass without the GIL.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__byteplanes(void) { return PyModule_Create(&module); }
