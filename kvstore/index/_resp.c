/* The RESP bytes of one index command (kvstore.index.held): what redis-py's packing makes
 * of it, in C. A 129-argument MGET (a keyed lookup of 128 pages, kvstore/index/lookups.py)
 * took redis-py 32-57 us, as much as the rest of the lookup; this 1.0 us (timeit, the
 * 2-core VM). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

/* An argument's bytes: bytes as they are, str as UTF-8, int in decimal (exact types only:
   bool and subclasses are left to redis-py, which refuses or formats them its way).
   *keep holds a temporary to release; 0 when the argument is of another type. */
static int arg_bytes(PyObject *arg, const char **buf, Py_ssize_t *len, PyObject **keep) {
    *keep = NULL;
    if (PyBytes_CheckExact(arg)) {
        *buf = PyBytes_AS_STRING(arg);
        *len = PyBytes_GET_SIZE(arg);
        return 1;
    }
    if (PyUnicode_CheckExact(arg)) {
        *buf = PyUnicode_AsUTF8AndSize(arg, len);
        return *buf != NULL;
    }
    if (PyLong_CheckExact(arg)) {
        *keep = PyObject_Str(arg);
        if (!*keep) return 0;
        *buf = PyUnicode_AsUTF8AndSize(*keep, len);
        return *buf != NULL;
    }
    return 0;
}

/* Decimal digits of v >= 0 (snprintf per argument cost more than the rest of a pack). */
static int digits(Py_ssize_t v) {
    int d = 1;
    while (v >= 10) {
        v /= 10;
        d++;
    }
    return d;
}

/* "$<len>\r\n" at `at`; returns the end. */
static char *put_len(char *at, Py_ssize_t len) {
    int d = digits(len);
    *at++ = '$';
    for (int i = d - 1; i >= 0; i--, len /= 10) at[i] = (char)('0' + len % 10);
    at += d;
    *at++ = '\r';
    *at++ = '\n';
    return at;
}

/* pack(args) -> bytes, or None when an argument is not bytes, str or int (the caller packs
   it with redis-py). args: a tuple. */
static PyObject *pack(PyObject *self, PyObject *args_tuple) {
    if (!PyTuple_Check(args_tuple)) {
        PyErr_SetString(PyExc_TypeError, "pack takes a tuple");
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(args_tuple), total = 0;
    const char **bufs = PyMem_Malloc(sizeof(char *) * (n ? n : 1));
    Py_ssize_t *lens = PyMem_Malloc(sizeof(Py_ssize_t) * (n ? n : 1));
    PyObject **keeps = PyMem_Calloc(n ? n : 1, sizeof(PyObject *));
    PyObject *out = NULL;
    if (!bufs || !lens || !keeps) {
        PyErr_NoMemory();
        goto done;
    }
    char head[32];
    int head_len = snprintf(head, sizeof head, "*%zd\r\n", n);
    total = head_len;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!arg_bytes(PyTuple_GET_ITEM(args_tuple, i), &bufs[i], &lens[i], &keeps[i])) {
            if (PyErr_Occurred()) goto done;
            out = Py_NewRef(Py_None);
            goto done;
        }
        total += 1 + digits(lens[i]) + 2 + lens[i] + 2;
    }
    out = PyBytes_FromStringAndSize(NULL, total);
    if (!out) goto done;
    char *at = PyBytes_AS_STRING(out);
    memcpy(at, head, head_len);
    at += head_len;
    for (Py_ssize_t i = 0; i < n; i++) {
        at = put_len(at, lens[i]);
        memcpy(at, bufs[i], lens[i]);
        at += lens[i];
        *at++ = '\r';
        *at++ = '\n';
    }
done:
    if (keeps)
        for (Py_ssize_t i = 0; i < n; i++) Py_XDECREF(keeps[i]);
    PyMem_Free(bufs);
    PyMem_Free(lens);
    PyMem_Free(keeps);
    return out;
}

static PyMethodDef METHODS[] = {
    {"pack", pack, METH_O,
     "pack(args: tuple) -> the RESP bytes of the command args (bytes as they are, str as "
     "UTF-8, int in decimal), or None when an argument is of another type."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "_resp", NULL, -1, METHODS};

PyMODINIT_FUNC PyInit__resp(void) { return PyModule_Create(&MODULE); }
