/* For _match.c: the index entry's fields, read in place (docs/key-format.md; the layout
 * is in _match.c's opening comment), and the buffer views its functions read their
 * arguments through. Static functions, for the one module that includes it (after
 * Python.h, with PY_SSIZE_T_CLEAN defined). */
#ifndef KVSTORE_MATCH_ENTRIES_H
#define KVSTORE_MATCH_ENTRIES_H

#include <stdint.h>
#include <string.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "index entries are little-endian; this module reads them in place"
#endif

#define ENTRY 48
#define UNIT_MASK 0xFFFF

static uint64_t u64_at(const char *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}
static uint32_t u32_at(const char *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}
static uint16_t u16_at(const char *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* A read-only contiguous view of obj whose size is a multiple of `item` bytes. */
static int view(PyObject *obj, Py_buffer *buf, Py_ssize_t item, const char *what) {
    if (PyObject_GetBuffer(obj, buf, PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (buf->len % item) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes is not a whole number of %zd-byte items",
                     what, buf->len, item);
        PyBuffer_Release(buf);
        return -1;
    }
    return 0;
}

/* Per-position int64 values (`needs` or `firsts`): None, or at least `count` of them. */
static int optional_view(PyObject *obj, Py_buffer *buf, Py_ssize_t count, const char *what) {
    buf->obj = NULL;
    buf->buf = NULL;
    if (obj == Py_None) return 0;
    if (view(obj, buf, 8, what) < 0) return -1;
    if (buf->len / 8 < count) {
        PyErr_Format(PyExc_ValueError, "%s: %zd values for %zd positions", what, buf->len / 8,
                     count);
        PyBuffer_Release(buf);
        return -1;
    }
    return 0;
}

static void release(Py_buffer *buf) {
    if (buf->obj) PyBuffer_Release(buf);
}

/* A bytearray of `len` bytes (filled by the caller, then cut with PyByteArray_Resize). */
static PyObject *out_bytes(Py_ssize_t len) { return PyByteArray_FromStringAndSize(NULL, len); }

#endif /* KVSTORE_MATCH_ENTRIES_H */
