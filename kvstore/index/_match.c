/* Which index entries answer a lookup, and which of them are live (kvstore.index.entry_picks
 * and records): one pass over the 48-byte entries in C where numpy made about 30 calls.
 * The scheduler asks after pauses, and each numpy call cost 5-30 us in a first lookup
 * after 1 s of quiet (cold caches): picking and resolving 16 blocks took 0.26 ms cold
 * (0.09 warm), this module's two calls (bench/lookup.py --paused-only, docs/benchmarks.md).
 *
 * An entry (docs/key-format.md), little-endian: h0 u64 @0, h1 u64 @8, node u32 @16,
 * pos u16 @20, flags u16 @22, size u32 @24, tag u32 @28, slot u64 @32, checksum u64 @40.
 * Unit u of a block is its chain hash with h1 XOR u (kvstore.pages.heads, UNIT_MASK). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_match_entries.h"

/* pick(blob, recs, runs, first, need, firsts, needs) -> (recs, positions, units)

   blob: the asked hashes, 16 bytes each. recs: the entries read, in the order of runs.
   runs: int64 quads (count, start, length, shift), one per segment read: its next
   `count` entries are of the segment whose first position in the lookup is `start`
   (negative: a segment past the prefix, none counts), `length` positions long; an
   entry's position is its pos field less `shift` (a chain asked from the middle of its
   first segment). An entry counts when its position lies in the segment and it is a unit
   u of the hash asked there with first <= u < first + need (firsts, needs: per position,
   when not None). Returns the counted entries, their positions and their units counted
   from first, as bytearrays (48-byte entries, int64, int64). */
static PyObject *pick(PyObject *self, PyObject *args) {
    PyObject *blob_o, *recs_o, *runs_o, *firsts_o, *needs_o;
    Py_ssize_t first, need;
    if (!PyArg_ParseTuple(args, "OOOnnOO", &blob_o, &recs_o, &runs_o, &first, &need, &firsts_o,
                          &needs_o))
        return NULL;
    Py_buffer blob, recs, runs, firsts, needs;
    PyObject *out_recs = NULL, *out_pos = NULL, *out_units = NULL, *result = NULL;
    if (view(blob_o, &blob, 16, "blob") < 0) return NULL;
    if (view(recs_o, &recs, ENTRY, "recs") < 0) goto no_recs;
    if (view(runs_o, &runs, 32, "runs") < 0) goto no_runs;
    Py_ssize_t n = blob.len / 16, m = recs.len / ENTRY, nruns = runs.len / 32;
    if (optional_view(firsts_o, &firsts, n, "firsts") < 0) goto no_firsts;
    if (optional_view(needs_o, &needs, n, "needs") < 0) goto no_needs;
    const int64_t *run = runs.buf;
    Py_ssize_t total = 0;
    for (Py_ssize_t k = 0; k < nruns; k++) {
        if (run[4 * k] < 0) {
            PyErr_SetString(PyExc_ValueError, "runs: a negative entry count");
            goto done;
        }
        total += run[4 * k];
    }
    if (total != m) {
        PyErr_Format(PyExc_ValueError, "runs count %zd entries, recs holds %zd", total, m);
        goto done;
    }
    out_recs = out_bytes(m * ENTRY);
    out_pos = out_bytes(m * 8);
    out_units = out_bytes(m * 8);
    if (!out_recs || !out_pos || !out_units) goto done;
    char *kept = PyByteArray_AS_STRING(out_recs);
    int64_t *pos_out = (int64_t *)PyByteArray_AS_STRING(out_pos);
    int64_t *unit_out = (int64_t *)PyByteArray_AS_STRING(out_units);
    const char *asked = blob.buf, *rec = recs.buf;
    const int64_t *fs = firsts.buf, *ns = needs.buf;
    Py_ssize_t count = 0;
    for (Py_ssize_t k = 0; k < nruns; k++) {
        int64_t entries = run[4 * k], start = run[4 * k + 1], length = run[4 * k + 2],
                shift = run[4 * k + 3];
        for (int64_t e = 0; e < entries; e++, rec += ENTRY) {
            int64_t p = (int64_t)u16_at(rec + 20) - shift;
            if (start < 0 || p < 0 || p >= length || start + p >= n) continue;
            int64_t position = start + p;
            const char *h = asked + 16 * position;
            uint64_t delta = u64_at(h + 8) ^ u64_at(rec + 8);
            if (u64_at(h) != u64_at(rec) || delta > UNIT_MASK) continue;  // another block's
            int64_t unit = (int64_t)delta - (fs ? fs[position] : first);
            if (unit < 0 || unit >= (ns ? ns[position] : need)) continue;
            memcpy(kept + ENTRY * count, rec, ENTRY);
            pos_out[count] = position;
            unit_out[count] = unit;
            count++;
        }
    }
    if (PyByteArray_Resize(out_recs, count * ENTRY) < 0 || PyByteArray_Resize(out_pos, count * 8) < 0 ||
        PyByteArray_Resize(out_units, count * 8) < 0)
        goto done;
    result = PyTuple_Pack(3, out_recs, out_pos, out_units);
done:
    Py_XDECREF(out_recs);
    Py_XDECREF(out_pos);
    Py_XDECREF(out_units);
    release(&needs);
no_needs:
    release(&firsts);
no_firsts:
    PyBuffer_Release(&runs);
no_runs:
    PyBuffer_Release(&recs);
no_recs:
    PyBuffer_Release(&blob);
    return result;
}

/* The registry's live incarnations: tags[number] is the 32-bit tag of node `number`'s
   current incarnation, or negative where no live node has that number. */
typedef struct {
    int64_t *tags;
    Py_ssize_t size;
} Live;

static int read_live(PyObject *tags_o, Live *live) {
    PyObject *seq = PySequence_Fast(tags_o, "tags must be a sequence of ints");
    if (!seq) return -1;
    live->size = PySequence_Fast_GET_SIZE(seq);
    live->tags = PyMem_Malloc(sizeof(int64_t) * (live->size ? live->size : 1));
    if (!live->tags) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < live->size; i++) {
        live->tags[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
        if (live->tags[i] == -1 && PyErr_Occurred()) {
            PyMem_Free(live->tags);
            Py_DECREF(seq);
            return -1;
        }
    }
    Py_DECREF(seq);
    return 0;
}

static int is_live(const Live *live, const char *rec) {
    uint32_t node = u32_at(rec + 16);
    return node < (uint64_t)live->size && live->tags[node] >= 0 &&
           (uint64_t)live->tags[node] == u32_at(rec + 28);
}

static int by_value(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* An IndexLookup's parts, read in place: entries, their positions and units. */
typedef struct {
    Py_buffer recs, positions, units, needs;
    Py_ssize_t m, covered, need;
} Found;

static int read_found(PyObject *recs_o, PyObject *pos_o, PyObject *units_o, Py_ssize_t covered,
                      Py_ssize_t need, PyObject *needs_o, Found *f) {
    f->covered = covered;
    f->need = need;
    if (covered < 0) {
        PyErr_SetString(PyExc_ValueError, "covered must be at least 0");
        return -1;
    }
    if (view(recs_o, &f->recs, ENTRY, "records") < 0) return -1;
    f->m = f->recs.len / ENTRY;
    if (view(pos_o, &f->positions, 8, "positions") < 0) goto no_pos;
    if (view(units_o, &f->units, 8, "units") < 0) goto no_units;
    if (f->positions.len / 8 != f->m || f->units.len / 8 != f->m) {
        PyErr_Format(PyExc_ValueError, "%zd records, %zd positions and %zd units (int64 each)",
                     f->m, f->positions.len / 8, f->units.len / 8);
        goto no_needs;
    }
    if (optional_view(needs_o, &f->needs, covered, "needs") < 0) goto no_needs;
    return 0;
no_needs:
    PyBuffer_Release(&f->units);
no_units:
    PyBuffer_Release(&f->positions);
no_pos:
    PyBuffer_Release(&f->recs);
    return -1;
}

static void release_found(Found *f) {
    release(&f->needs);
    PyBuffer_Release(&f->units);
    PyBuffer_Release(&f->positions);
    PyBuffer_Release(&f->recs);
}

/* An IndexLookup's parts and the live tags, both read or neither (an exception set). */
static int read_found_live(PyObject *recs_o, PyObject *pos_o, PyObject *units_o, PyObject *tags_o,
                           Py_ssize_t covered, Py_ssize_t need, PyObject *needs_o, Found *f,
                           Live *live) {
    if (read_found(recs_o, pos_o, units_o, covered, need, needs_o, f) < 0) return -1;
    if (read_live(tags_o, live) < 0) {
        release_found(f);
        return -1;
    }
    return 0;
}

/* ok[i]: entry i is of a live incarnation; has[p] (covered + 1 bytes, the last a 0
   sentinel): every unit asked at position p has a live entry. Returns -1 with an
   exception set on failure. */
static int liveness(const Found *f, const Live *live, char *ok, char *has) {
    const char *recs = f->recs.buf;
    const int64_t *pos = f->positions.buf, *units = f->units.buf, *needs = f->needs.buf;
    int64_t width = f->need;
    if (needs) {
        width = 1;
        for (Py_ssize_t p = 0; p < f->covered; p++)
            if (needs[p] > width) width = needs[p];
    }
    memset(has, 0, f->covered + 1);
    Py_ssize_t lived = 0;
    for (Py_ssize_t i = 0; i < f->m; i++) {
        ok[i] = (char)is_live(live, recs + ENTRY * i);
        lived += ok[i];
    }
    if (width == 1) {
        for (Py_ssize_t i = 0; i < f->m; i++)
            if (ok[i] && pos[i] >= 0 && pos[i] < f->covered) has[pos[i]] = 1;
        return 0;
    }
    /* every unit asked at a position needs a live entry: count the distinct ones */
    int64_t *keys = PyMem_Malloc(sizeof(int64_t) * (lived ? lived : 1));
    if (!keys) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < f->m; i++)
        if (ok[i] && pos[i] >= 0 && pos[i] < f->covered && units[i] >= 0 && units[i] < width)
            keys[k++] = pos[i] * width + units[i];
    qsort(keys, k, sizeof(int64_t), by_value);
    for (Py_ssize_t i = 0; i < k;) {
        int64_t p = keys[i] / width, distinct = 0;
        for (int64_t last = -1; i < k && keys[i] / width == p; i++) {
            distinct += keys[i] != last;
            last = keys[i];
        }
        has[p] = distinct == (needs ? needs[p] : f->need);
    }
    PyMem_Free(keys);
    return 0;
}

/* resolve(recs, positions, units, tags, covered, need, needs, last) -> (matched, recs,
   positions, units): IndexLookup.resolve. The prefix ends at the first position without
   a live entry of every unit asked there (`last`: after the last position with them),
   and the live entries of positions before it (`last`: of that position) are kept. */
static PyObject *resolve(PyObject *self, PyObject *args) {
    PyObject *recs_o, *pos_o, *units_o, *tags_o, *needs_o;
    Py_ssize_t covered, need;
    int last;
    if (!PyArg_ParseTuple(args, "OOOOnnOp", &recs_o, &pos_o, &units_o, &tags_o, &covered, &need,
                          &needs_o, &last))
        return NULL;
    Found f;
    Live live;
    if (read_found_live(recs_o, pos_o, units_o, tags_o, covered, need, needs_o, &f, &live) < 0)
        return NULL;
    PyObject *result = NULL, *out_recs = NULL, *out_pos = NULL, *out_units = NULL;
    char *ok = PyMem_Malloc(f.m + f.covered + 2);
    if (!ok) {
        PyErr_NoMemory();
        goto done;
    }
    char *has = ok + f.m + 1;
    if (liveness(&f, &live, ok, has) < 0) goto done;
    Py_ssize_t matched = 0;
    if (last) {
        for (Py_ssize_t p = f.covered - 1; p >= 0; p--)
            if (has[p]) {
                matched = p + 1;
                break;
            }
    } else {
        while (has[matched]) matched++;  // the sentinel stops it at covered
    }
    out_recs = out_bytes(f.m * ENTRY);
    out_pos = out_bytes(f.m * 8);
    out_units = out_bytes(f.m * 8);
    if (!out_recs || !out_pos || !out_units) goto done;
    const int64_t *pos = f.positions.buf, *units = f.units.buf;
    Py_ssize_t count = 0;
    for (Py_ssize_t i = 0; i < f.m; i++) {
        if (!ok[i] || (last ? pos[i] != matched - 1 : pos[i] >= matched)) continue;
        memcpy(PyByteArray_AS_STRING(out_recs) + ENTRY * count, (const char *)f.recs.buf + ENTRY * i,
               ENTRY);
        ((int64_t *)PyByteArray_AS_STRING(out_pos))[count] = pos[i];
        ((int64_t *)PyByteArray_AS_STRING(out_units))[count] = units[i];
        count++;
    }
    if (PyByteArray_Resize(out_recs, count * ENTRY) < 0 || PyByteArray_Resize(out_pos, count * 8) < 0 ||
        PyByteArray_Resize(out_units, count * 8) < 0)
        goto done;
    result = Py_BuildValue("nOOO", matched, out_recs, out_pos, out_units);
done:
    Py_XDECREF(out_recs);
    Py_XDECREF(out_pos);
    Py_XDECREF(out_units);
    PyMem_Free(ok);
    PyMem_Free(live.tags);
    release_found(&f);
    return result;
}

/* present(recs, positions, units, tags, covered, need, needs) -> bytearray: per position
   covered, 1 when every unit asked there has a live entry (IndexLookup.present). */
static PyObject *present(PyObject *self, PyObject *args) {
    PyObject *recs_o, *pos_o, *units_o, *tags_o, *needs_o;
    Py_ssize_t covered, need;
    if (!PyArg_ParseTuple(args, "OOOOnnO", &recs_o, &pos_o, &units_o, &tags_o, &covered, &need,
                          &needs_o))
        return NULL;
    Found f;
    Live live;
    if (read_found_live(recs_o, pos_o, units_o, tags_o, covered, need, needs_o, &f, &live) < 0)
        return NULL;
    PyObject *has = NULL;
    char *ok = PyMem_Malloc(f.m + 1);
    if (!ok) {
        PyErr_NoMemory();
        goto done;
    }
    has = out_bytes(f.covered + 1);
    if (!has) goto done;
    if (liveness(&f, &live, ok, PyByteArray_AS_STRING(has)) < 0 ||
        PyByteArray_Resize(has, f.covered) < 0)
        Py_CLEAR(has);
done:
    PyMem_Free(ok);
    PyMem_Free(live.tags);
    release_found(&f);
    return has;
}

/* live(recs, tags) -> bytearray: per entry, 1 when it is of a live incarnation. */
static PyObject *live_entries(PyObject *self, PyObject *args) {
    PyObject *recs_o, *tags_o;
    if (!PyArg_ParseTuple(args, "OO", &recs_o, &tags_o)) return NULL;
    Py_buffer recs;
    Live live;
    if (view(recs_o, &recs, ENTRY, "records") < 0) return NULL;
    if (read_live(tags_o, &live) < 0) {
        PyBuffer_Release(&recs);
        return NULL;
    }
    Py_ssize_t m = recs.len / ENTRY;
    PyObject *ok = out_bytes(m);
    if (ok)
        for (Py_ssize_t i = 0; i < m; i++)
            PyByteArray_AS_STRING(ok)[i] = (char)is_live(&live, (const char *)recs.buf + ENTRY * i);
    PyMem_Free(live.tags);
    PyBuffer_Release(&recs);
    return ok;
}

static PyMethodDef METHODS[] = {
    {"pick", pick, METH_VARARGS, "The entries that answer a lookup's asked hashes."},
    {"resolve", resolve, METH_VARARGS, "The live prefix of a lookup's entries."},
    {"present", present, METH_VARARGS, "Per position, whether a live entry of every unit is there."},
    {"live", live_entries, METH_VARARGS, "Per entry, whether it is of a live incarnation."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "_match", NULL, -1, METHODS};

PyMODINIT_FUNC PyInit__match(void) { return PyModule_Create(&MODULE); }
