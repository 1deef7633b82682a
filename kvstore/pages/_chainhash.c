/* Chained block hashes (docs/key-format.md "Block hashes") in one C loop.
 *
 * kvstore.pages.hashing calls chain() for every lookup, put and get; in Python the loop
 * costs about 0.9 us per block in interpreter overhead alone (8,192 blocks: 7-17 ms
 * measured here), which is more than the whole lookup budget. BLAKE2b (RFC 7693) is
 * written out in _blake2b.h. Its compression stays scalar: a chain is one long
 * dependency, and an AVX2 version (the four G columns in one register) was 20 % slower
 * here (1.27 against 1.55 ms for 8,192 compressions, Zen 3). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_blake2b.h"

/* The items of a list or tuple (borrowed) in *items and their count in *n, and 1; 0
   with TypeError `refusal` for anything else. (*items of an empty list is NULL.) */
static int seq_items(PyObject *seq, const char *refusal, PyObject ***items, Py_ssize_t *n) {
    if (!PyList_Check(seq) && !PyTuple_Check(seq)) {
        PyErr_SetString(PyExc_TypeError, refusal);
        return 0;
    }
    *n = PySequence_Fast_GET_SIZE(seq);
    *items = PySequence_Fast_ITEMS(seq);
    return 1;
}

/* 1 with the value in *v when `o` is an exact int that CPython stores in one digit
   (below 2**30: every token id of a real vocabulary); 0 otherwise, for the general
   path. Reading the value in place instead of through
   PyLong_AsUnsignedLong took 131,072 ids from 0.42 to 0.28 ms (interleaved, measured
   here). */
static inline int small_uint(PyObject *o, uint32_t *v) {
    if (!PyLong_CheckExact(o)) return 0;
#if PY_VERSION_HEX >= 0x030C0000
    if (!PyUnstable_Long_IsCompact((PyLongObject *)o)) return 0;
    Py_ssize_t x = PyUnstable_Long_CompactValue((PyLongObject *)o);
    if (x < 0) return 0; /* compact means one digit: below 2**30, so it fits */
    *v = (uint32_t)x;
#else
    Py_ssize_t size = Py_SIZE(o); /* digits, negative for a negative int */
    if (size == 0)
        *v = 0;
    else if (size == 1)
        *v = (uint32_t)((PyLongObject *)o)->ob_digit[0]; /* one 30-bit digit */
    else
        return 0;
#endif
    return 1;
}

/* items[0..n) as little-endian uint32 into dst, range-checked; 0 with OverflowError
   (an int outside [0, 2**32)) or TypeError (not an int) naming token `first + i`. */
static int tokens_le(PyObject **items, Py_ssize_t n, Py_ssize_t first, uint8_t *dst) {
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = items[i];
        uint32_t v;
        if (!small_uint(item, &v)) {
            if (!PyLong_Check(item)) {
                PyErr_Format(PyExc_TypeError, "token %zd is %.50s, not an int", first + i, Py_TYPE(item)->tp_name);
                return 0;
            }
            unsigned long big = PyLong_AsUnsignedLong(item); /* OverflowError for negatives too */
            if ((big == (unsigned long)-1 && PyErr_Occurred()) || big > 0xFFFFFFFFUL) {
                if (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_OverflowError)) {
                    PyErr_Clear();
                    PyErr_Format(PyExc_OverflowError, "token %zd does not fit in uint32", first + i);
                }
                return 0;
            }
            v = (uint32_t)big;
        }
        memcpy(dst + 4 * i, &v, 4); /* little-endian hosts only: checked at import */
    }
    return 1;
}

/* A list or tuple of ints as little-endian uint32 bytes, range-checked: what
   array.array("I", tokens) does, in one pass without its per-item overhead. Raises
   OverflowError for an int outside [0, 2**32) and TypeError for anything not an int. */
static PyObject *uint32_le(PyObject *self, PyObject *seq) {
    Py_ssize_t n;
    PyObject **items;
    if (!seq_items(seq, "uint32_le takes a list or tuple of ints", &items, &n)) return NULL;
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 4);
    if (out && !tokens_le(items, n, 0, (uint8_t *)PyBytes_AS_STRING(out))) Py_CLEAR(out);
    return out;
}

/* One link of a chain: hash(prefix || prev || data) with prev the link before. Where
 * prefix, previous hash and one block of tokens fit one BLAKE2b block (a 16-byte
 * namespace digest and up to 24 tokens: every usual block size), one buffer holds them
 * with the prefix in place and each hash written into it for the next: one compression
 * per block, 7 % faster than hash3 for 8,192 blocks (interleaved, measured here). */
typedef struct {
    uint64_t init[8];
    const uint8_t *prefix;
    size_t nprefix, step;
    int one_block;
    uint8_t buf[BLOCK]; /* prefix || prev || data || zeros when one_block; else prev first */
} Chain;

static void chain_next(Chain *c, const uint8_t *data, uint8_t out[HASH_BYTES]) {
    if (c->one_block) {
        uint64_t h[8];
        memcpy(c->buf + c->nprefix + HASH_BYTES, data, c->step);
        memcpy(h, c->init, sizeof h);
        compress(h, c->buf, c->nprefix + HASH_BYTES + c->step, 1);
        memcpy(out, h, HASH_BYTES);
        memcpy(c->buf + c->nprefix, h, HASH_BYTES);
    } else {
        hash3(c->init, c->prefix, c->nprefix, c->buf, HASH_BYTES, data, c->step, out);
        memcpy(c->buf, out, HASH_BYTES);
    }
}

/* chain(prefix, tokens, step, person, start): see METHODS. `tokens` is a buffer of
 * uint32-le token ids or a list or tuple of ints, converted a block at a time: a whole
 * list converted first is a 512 KiB buffer for 8,192 blocks, which glibc handed back to
 * the kernel between calls here (97 page faults, 0.3 ms, per lookup after other large
 * allocations). Every token of a list is checked, a trailing partial block's too. */
static PyObject *chain(PyObject *self, PyObject *args) {
    Py_buffer prefix, person, start, tokens = {0};
    PyObject *source, *out = NULL, **items = NULL;
    Py_ssize_t step, ntokens = 0;
    uint8_t *scratch = NULL;
    if (!PyArg_ParseTuple(args, "y*Ony*y*", &prefix, &source, &step, &person, &start)) return NULL;
    if (person.len > 16 || start.len != HASH_BYTES || step <= 0 || step % 4) {
        PyErr_SetString(PyExc_ValueError, "chain(prefix, tokens, step, person<=16 bytes, start 16 bytes, step a positive multiple of 4)");
        goto done;
    }
    if (PyList_Check(source) || PyTuple_Check(source)) {
        seq_items(source, "", &items, &ntokens);
        if (!(scratch = PyMem_Malloc(step))) {
            PyErr_NoMemory();
            goto done;
        }
    } else if (PyObject_GetBuffer(source, &tokens, PyBUF_C_CONTIGUOUS) < 0) {
        goto done;
    }
    Chain c = {.prefix = prefix.buf, .nprefix = prefix.len, .step = step, .one_block = prefix.len + HASH_BYTES + step <= BLOCK};
    uint8_t pers[16] = {0};
    memcpy(pers, person.buf, person.len);
    memcpy(c.init, IV, sizeof c.init);
    c.init[0] ^= 0x01010000ULL ^ HASH_BYTES; /* depth 1, fanout 1, no key, 16-byte digest */
    c.init[6] ^= load64(pers);
    c.init[7] ^= load64(pers + 8);
    if (c.one_block) {
        memcpy(c.buf, prefix.buf, prefix.len);
        memcpy(c.buf + prefix.len, start.buf, HASH_BYTES);
    } else {
        memcpy(c.buf, start.buf, HASH_BYTES);
    }
    Py_ssize_t per = step / 4, count = items ? ntokens / per : tokens.len / step;
    /* One bytes object, not one per block: making 8,192 bytes objects took 0.25 ms and
       freeing them 0.1, a fifth of the chain (measured here); lookups need the joined
       form anyway, and split_hashes makes the list where one is wanted. */
    out = PyBytes_FromStringAndSize(NULL, count * HASH_BYTES);
    if (!out) goto done;
    uint8_t *digests = (uint8_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < count; i++) {
        if (items && !tokens_le(items + i * per, per, i * per, scratch)) {
            Py_CLEAR(out);
            goto done;
        }
        chain_next(&c, items ? scratch : (const uint8_t *)tokens.buf + i * step, digests + i * HASH_BYTES);
    }
    if (items && !tokens_le(items + count * per, ntokens - count * per, count * per, scratch)) Py_CLEAR(out);
done:
    PyMem_Free(scratch);
    PyBuffer_Release(&prefix);
    if (tokens.obj) PyBuffer_Release(&tokens);
    PyBuffer_Release(&person);
    PyBuffer_Release(&start);
    return out;
}

/* The 16-byte hashes of a list or tuple joined into one bytes object: what
   b"".join(hashes) does after checking every item, in one pass. Python's own check
   (set(map(len, hashes))) cost 0.44 ms for 8,192 hashes, more than the join, on every
   lookup. Where an item is not bytes of exactly HASH_BYTES it returns that item's index
   (an int) instead, so the caller names the fault in its own words. */
static PyObject *join_hashes(PyObject *self, PyObject *seq) {
    Py_ssize_t n;
    PyObject **items;
    if (!seq_items(seq, "join_hashes takes a list or tuple of bytes or bytearrays", &items, &n)) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *h = items[i];
        Py_ssize_t len = PyBytes_Check(h) ? PyBytes_GET_SIZE(h) : PyByteArray_Check(h) ? PyByteArray_GET_SIZE(h) : -1;
        if (len != HASH_BYTES) return PyLong_FromSsize_t(i);
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * HASH_BYTES);
    if (!out) return NULL;
    char *dst = PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *h = items[i];
        memcpy(dst + i * HASH_BYTES, PyBytes_Check(h) ? PyBytes_AS_STRING(h) : PyByteArray_AS_STRING(h), HASH_BYTES);
    }
    return out;
}

/* bytes of n * HASH_BYTES cut into a list of n bytes objects: join_hashes undone. */
static PyObject *split_hashes(PyObject *self, PyObject *arg) {
    if (!PyBytes_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "split_hashes takes bytes");
        return NULL;
    }
    Py_ssize_t len = PyBytes_GET_SIZE(arg);
    if (len % HASH_BYTES) {
        PyErr_Format(PyExc_ValueError, "split_hashes: %zd bytes is not a whole number of %d-byte hashes", len, HASH_BYTES);
        return NULL;
    }
    const char *src = PyBytes_AS_STRING(arg);
    PyObject *out = PyList_New(len / HASH_BYTES);
    for (Py_ssize_t i = 0; out && i < len / HASH_BYTES; i++) {
        PyObject *item = PyBytes_FromStringAndSize(src + i * HASH_BYTES, HASH_BYTES);
        if (!item) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, item);
    }
    return out;
}

/* each(prefix, keys, person): see METHODS. Keys of a keyed layout (an engine's own page
 * keys, e.g. SGLang's 64-hex-digit hashes) hash one call each: 128 keys took 42 us in
 * hashlib's loop (a copied state per key), a fifth of the lookup they are asked in. */
static PyObject *each(PyObject *self, PyObject *args) {
    Py_buffer prefix, person;
    PyObject *seq, *out = NULL, **items;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "y*Oy*", &prefix, &seq, &person)) return NULL;
    if (person.len > 16) {
        PyErr_SetString(PyExc_ValueError, "each(prefix, keys, person<=16 bytes)");
        goto done;
    }
    if (!seq_items(seq, "each takes a list or tuple of str", &items, &n)) goto done;
    uint64_t init[8];
    uint8_t pers[16] = {0};
    memcpy(pers, person.buf, person.len);
    memcpy(init, IV, sizeof init);
    init[0] ^= 0x01010000ULL ^ HASH_BYTES; /* depth 1, fanout 1, no key, 16-byte digest */
    init[6] ^= load64(pers);
    init[7] ^= load64(pers + 8);
    out = PyBytes_FromStringAndSize(NULL, n * HASH_BYTES);
    if (!out) goto done;
    uint8_t *digests = (uint8_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t len;
        const char *key = PyUnicode_Check(items[i]) ? PyUnicode_AsUTF8AndSize(items[i], &len) : NULL;
        if (!key || len == 0) {
            if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "%zd", i);
            Py_CLEAR(out);
            goto done;
        }
        hash3(init, prefix.buf, prefix.len, (const uint8_t *)key, len, NULL, 0, digests + i * HASH_BYTES);
    }
done:
    PyBuffer_Release(&prefix);
    PyBuffer_Release(&person);
    return out;
}

/* head || hex(h) || tail for every 16-byte h of joined, as a list of bytes: the index
   keys of hashes that are each a segment of their own (kvstore.index.lookups, one MGET of
   a keyed batch). 128 names took 40 us as Python f-strings, this 7.5 (timeit, the
   2-core VM). */
static PyObject *hex_names(PyObject *self, PyObject *args) {
    Py_buffer head, joined, tail;
    PyObject *out = NULL;
    static const char HEX[] = "0123456789abcdef";
    if (!PyArg_ParseTuple(args, "y*y*y*", &head, &joined, &tail)) return NULL;
    if (joined.len % HASH_BYTES) {
        PyErr_Format(PyExc_ValueError, "hex_names: %zd bytes is not a whole number of %d-byte hashes", joined.len, HASH_BYTES);
        goto done;
    }
    Py_ssize_t n = joined.len / HASH_BYTES, size = head.len + 2 * HASH_BYTES + tail.len;
    out = PyList_New(n);
    if (!out) goto done;
    const uint8_t *h = (const uint8_t *)joined.buf;
    for (Py_ssize_t i = 0; i < n; i++, h += HASH_BYTES) {
        PyObject *name = PyBytes_FromStringAndSize(NULL, size);
        if (!name) {
            Py_CLEAR(out);
            goto done;
        }
        char *at = PyBytes_AS_STRING(name);
        memcpy(at, head.buf, head.len);
        at += head.len;
        for (int b = 0; b < HASH_BYTES; b++) {
            *at++ = HEX[h[b] >> 4];
            *at++ = HEX[h[b] & 15];
        }
        memcpy(at, tail.buf, tail.len);
        PyList_SET_ITEM(out, i, name);
    }
done:
    PyBuffer_Release(&head);
    PyBuffer_Release(&joined);
    PyBuffer_Release(&tail);
    return out;
}

static PyMethodDef METHODS[] = {
    {"uint32_le", uint32_le, METH_O,
     "uint32_le(list or tuple of ints) -> bytes: each as little-endian uint32 (OverflowError\n"
     "outside [0, 2**32), TypeError for a non-int)."},
    {"join_hashes", join_hashes, METH_O,
     "join_hashes(list or tuple of bytes/bytearray) -> bytes, the items joined when every one\n"
     "is exactly 16 bytes; else the index (int) of the first that is not."},
    {"split_hashes", split_hashes, METH_O,
     "split_hashes(bytes of n * 16) -> list of the n 16-byte pieces (join_hashes undone)."},
    {"hex_names", hex_names, METH_VARARGS,
     "hex_names(head, joined, tail) -> [head || hex(h) || tail for every 16-byte h of joined],\n"
     "as bytes (ValueError when joined is not whole hashes)."},
    {"chain", chain, METH_VARARGS,
     "chain(prefix, data, step, person, start) -> the 16-byte digests joined, in order.\n"
     "data: uint32-le token ids (a buffer) or a list or tuple of ints (OverflowError, TypeError\n"
     "as uint32_le names them).\n\n"
     "h[-1] = start; h[i] = blake2b-128(prefix || h[i-1] || data[i*step:(i+1)*step],\n"
     "person=person) for every whole step of data."},
    {"each", each, METH_VARARGS,
     "each(prefix, keys, person) -> blake2b-128(prefix || key as UTF-8, person=person) of every\n"
     "key (a non-empty str), joined in order; ValueError naming the index of one that is not."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "_chainhash", NULL, -1, METHODS};

PyMODINIT_FUNC PyInit__chainhash(void) {
    const uint16_t probe = 1;
    if (*(const uint8_t *)&probe != 1) {
        PyErr_SetString(PyExc_ImportError, "kvstore.pages._chainhash supports little-endian hosts only");
        return NULL;
    }
    return PyModule_Create(&MODULE);
}
