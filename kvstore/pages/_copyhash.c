/* Copy pages and hash them with xxh3-64 in one C loop, without the GIL
 * (kvstore.pages.checksum.copy_checksummed; docs/protocol.md "Same host").
 *
 * The same-host data path copies every page once, between a node's mapped slot and
 * the caller's memory, and hashes it while each chunk is still in cache. In Python
 * that loop cost 960 numpy slices, assignments and hash updates for the TTFT bench's
 * 120 MiB load (10 layers of 96 blocks): 20.9 ms on two threads, where this loop takes
 * about half (figures in checksum.py). The hash is xxhash's own: bind() looks up
 * XXH3_64bits_reset/update/digest in the xxhash module Python has already loaded
 * (its symbols are exported), so the digests are those of xxhash.xxh3_64 by
 * construction; checksum.py checks that at import and keeps the Python loop when
 * bind() finds no such functions. */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

typedef void *(*create_fn)(void);
typedef int (*free_fn)(void *);
typedef int (*reset_fn)(void *);
typedef int (*update_fn)(void *, const void *, size_t);
typedef uint64_t (*digest_fn)(const void *);

static create_fn xxh_create;
static free_fn xxh_free;
static reset_fn xxh_reset;
static update_fn xxh_update;
static digest_fn xxh_digest;

/* Bytes copied, then hashed, at a time: both sides of a sub-chunk stay in L2 (1 MiB
 * here), so the hash reads what the copy just touched. */
#define SUB (64 * 1024)

/* One contiguous range of a page that lies in one piece on each side. */
typedef struct {
    char *dst;
    const char *src;
    size_t len;
} segment;

/* Non-temporal stores: the copy does not read the destination's lines in first (the
 * CPU's read for ownership), and the pages do not evict the cache. Used only when the
 * hashed side is the source, since the destination is then not read back. */
static void copy_stream(char *dst, const char *src, size_t n) {
#if defined(__x86_64__)
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    for (; n >= 64; n -= 64, dst += 64, src += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src), b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32)), d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
    }
    memcpy(dst, src, n);
#else
    memcpy(dst, src, n);
#endif
}

static PyObject *bind(PyObject *self, PyObject *arg) {
    const char *path = PyUnicode_AsUTF8(arg);
    if (!path)
        return NULL;
    void *lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (!lib)
        Py_RETURN_FALSE;
    xxh_create = (create_fn)dlsym(lib, "XXH3_createState");
    xxh_free = (free_fn)dlsym(lib, "XXH3_freeState");
    xxh_reset = (reset_fn)dlsym(lib, "XXH3_64bits_reset");
    xxh_update = (update_fn)dlsym(lib, "XXH3_64bits_update");
    xxh_digest = (digest_fn)dlsym(lib, "XXH3_64bits_digest");
    if (!(xxh_create && xxh_free && xxh_reset && xxh_update && xxh_digest)) {
        xxh_create = NULL;
        Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

/* Growable arrays of what one call holds: the buffers to release and the segments. */
typedef struct {
    char *buf;
    Py_ssize_t len;
} range_t;

typedef struct {
    Py_buffer *bufs;
    Py_ssize_t nbufs, capbufs;
    range_t *ranges;
    Py_ssize_t nranges, capranges;
    segment *segs;
    Py_ssize_t nsegs, capsegs;
} plan;

static void plan_free(plan *p) {
    for (Py_ssize_t i = 0; i < p->nbufs; i++)
        PyBuffer_Release(&p->bufs[i]);
    PyMem_Free(p->bufs);
    PyMem_Free(p->ranges);
    PyMem_Free(p->segs);
}

static void *grow(void *items, Py_ssize_t *cap, Py_ssize_t need, size_t item) {
    if (need <= *cap)
        return items;
    Py_ssize_t cap2 = *cap ? *cap * 2 : 64;
    while (cap2 < need)
        cap2 *= 2;
    void *out = PyMem_Realloc(items, (size_t)cap2 * item);
    if (!out) {
        PyErr_NoMemory();
        return NULL;
    }
    *cap = cap2;
    return out;
}

/* One contiguous byte range of a side, in the page's order. */
static int add_range(plan *p, char *buf, Py_ssize_t len) {
    range_t *r = grow(p->ranges, &p->capranges, p->nranges + 1, sizeof(range_t));
    if (!r)
        return -1;
    p->ranges = r;
    p->ranges[p->nranges++] = (range_t){buf, len};
    return 1;
}

/* The pieces of one side of a pair: a tuple of buffers, or one buffer, each C-contiguous or
 * made of C-contiguous rows along its first axis (a block's slice of every layer: one range
 * per row); 0 (no exception set) when one is neither, so the caller can fall back. */
static int side(plan *p, PyObject *obj, int writable, Py_ssize_t *first, Py_ssize_t *count) {
    int is_tuple = PyTuple_Check(obj);
    Py_ssize_t n = is_tuple ? PyTuple_GET_SIZE(obj) : 1;
    Py_buffer *bufs = grow(p->bufs, &p->capbufs, p->nbufs + n, sizeof(Py_buffer));
    if (!bufs)
        return -1;
    p->bufs = bufs;
    *first = p->nranges;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = is_tuple ? PyTuple_GET_ITEM(obj, i) : obj;
        Py_buffer *b = &p->bufs[p->nbufs];
        if (PyObject_GetBuffer(item, b, PyBUF_STRIDES | (writable ? PyBUF_WRITABLE : 0)) < 0) {
            PyErr_Clear();
            return 0;
        }
        p->nbufs++;
        if (PyBuffer_IsContiguous(b, 'C')) {
            if (add_range(p, b->buf, b->len) < 0)
                return -1;
            continue;
        }
        /* rows along the first axis, each C-contiguous (a block's slice of every layer) */
        if (b->ndim < 2 || !b->strides || b->strides[0] <= 0)
            return 0;
        Py_ssize_t row = b->itemsize;
        for (int d = b->ndim - 1; d >= 1; d--) {
            if (b->shape[d] > 1 && b->strides[d] != row)
                return 0;
            row *= b->shape[d];
        }
        for (Py_ssize_t r = 0; r < b->shape[0]; r++)
            if (add_range(p, (char *)b->buf + r * b->strides[0], row) < 0)
                return -1;
    }
    *count = p->nranges - *first;
    return 1;
}

/* copy_hash(pairs, hash_source, stream) -> list of digests, or None when a piece is
 * not C-contiguous (nothing was copied). */
static PyObject *copy_hash(PyObject *self, PyObject *args) {
    PyObject *pairs;
    int hash_source, stream;
    if (!PyArg_ParseTuple(args, "Opp", &pairs, &hash_source, &stream))
        return NULL;
    if (!xxh_create) {
        PyErr_SetString(PyExc_RuntimeError, "copy_hash: bind() found no xxh3 functions");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(pairs, "copy_hash needs a sequence of (dst, src) pairs");
    if (!seq)
        return NULL;
    Py_ssize_t npairs = PySequence_Fast_GET_SIZE(seq);
    plan p = {0};
    Py_ssize_t *ends = PyMem_Calloc((size_t)npairs + 1, sizeof(Py_ssize_t)); /* segments of pair k: ends[k-1]..ends[k] */
    char *hash_dst = PyMem_Calloc((size_t)npairs + 1, 1);                    /* per pair: hash the dst side? */
    uint64_t *digests = PyMem_Calloc((size_t)npairs + 1, sizeof(uint64_t));
    PyObject *out = NULL;
    if (!ends || !hash_dst || !digests) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t k = 0; k < npairs; k++) {
        PyObject *pair = PySequence_Fast_GET_ITEM(seq, k);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_Format(PyExc_TypeError, "copy_hash: pair %zd is not a (dst, src) tuple", k);
            goto done;
        }
        PyObject *dst = PyTuple_GET_ITEM(pair, 0), *src = PyTuple_GET_ITEM(pair, 1);
        Py_ssize_t d0, dn, s0, sn;
        int ok = side(&p, dst, 1, &d0, &dn);
        if (ok > 0)
            ok = side(&p, src, 0, &s0, &sn);
        if (ok < 0)
            goto done;
        if (ok == 0) {
            out = Py_None;
            Py_INCREF(out);
            goto done;
        }
        /* A scattered destination is never re-read: the source is hashed as it is read. A
         * scattered source is hashed as it is read too (not the destination after the write),
         * so the copy may use streaming stores: re-reading 2 MiB just written doubled insert's
         * copy time against put's. */
        int d_scattered = PyTuple_Check(dst);
        hash_dst[k] = d_scattered ? 0 : !hash_source;
        Py_ssize_t di = d0, si = s0, doff = 0, soff = 0;
        while (di < d0 + dn && si < s0 + sn) {
            Py_ssize_t dleft = p.ranges[di].len - doff, sleft = p.ranges[si].len - soff;
            Py_ssize_t len = dleft < sleft ? dleft : sleft;
            if (len > 0) {
                segment *segs = grow(p.segs, &p.capsegs, p.nsegs + 1, sizeof(segment));
                if (!segs)
                    goto done;
                p.segs = segs;
                p.segs[p.nsegs++] = (segment){p.ranges[di].buf + doff, (const char *)p.ranges[si].buf + soff, (size_t)len};
            }
            doff += len, soff += len;
            if (doff == p.ranges[di].len)
                di++, doff = 0;
            if (soff == p.ranges[si].len)
                si++, soff = 0;
        }
        for (; di < d0 + dn && p.ranges[di].len == doff; di++, doff = 0) {}
        for (; si < s0 + sn && p.ranges[si].len == soff; si++, soff = 0) {}
        if (di != d0 + dn || si != s0 + sn) {
            PyErr_Format(PyExc_ValueError, "copy_hash: pair %zd: destination and source differ in size", k);
            goto done;
        }
        ends[k] = p.nsegs;
    }
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
    void *state = xxh_create();
    if (!state) {
        failed = 1;
    } else {
        Py_ssize_t s = 0;
        for (Py_ssize_t k = 0; k < npairs; k++) {
            xxh_reset(state);
            for (; s < ends[k]; s++) {
                segment g = p.segs[s];
                for (size_t at = 0; at < g.len; at += SUB) {
                    size_t n = g.len - at < SUB ? g.len - at : SUB;
                    if (stream && !hash_dst[k])
                        copy_stream(g.dst + at, g.src + at, n);
                    else
                        memcpy(g.dst + at, g.src + at, n);
                    xxh_update(state, hash_dst[k] ? (const void *)(g.dst + at) : (const void *)(g.src + at), n);
                }
            }
            digests[k] = xxh_digest(state);
        }
        xxh_free(state);
#if defined(__x86_64__)
        if (stream)
            _mm_sfence(); /* the streamed stores are visible before the caller reads them */
#endif
    }
    Py_END_ALLOW_THREADS
    if (failed) {
        PyErr_NoMemory();
        goto done;
    }
    out = PyList_New(npairs);
    for (Py_ssize_t k = 0; out && k < npairs; k++) {
        PyObject *v = PyLong_FromUnsignedLongLong(digests[k]);
        if (!v) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, k, v);
    }
done:
    plan_free(&p);
    PyMem_Free(ends);
    PyMem_Free(hash_dst);
    PyMem_Free(digests);
    Py_DECREF(seq);
    return out;
}

static PyMethodDef METHODS[] = {
    {"bind", bind, METH_O,
     "bind(path of the loaded xxhash extension) -> True when its XXH3 functions were found."},
    {"copy_hash", copy_hash, METH_VARARGS,
     "copy_hash(pairs, hash_source, stream) -> list of xxh3-64 digests, or None.\n\n"
     "pairs: (dst, src), each side a C-contiguous buffer or a tuple of them (a scattered\n"
     "page, its pieces in page order); both sides the same size. Copies every pair and\n"
     "hashes, per pair, the contiguous side of a scattered page, else src (hash_source)\n"
     "or dst. stream: non-temporal stores where the source is hashed. Runs without the\n"
     "GIL. None, with nothing copied, when a piece is not C-contiguous."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "_copyhash", NULL, -1, METHODS};

PyMODINIT_FUNC PyInit__copyhash(void) { return PyModule_Create(&MODULE); }
