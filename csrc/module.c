/* CPython glue for moestream._C: argument checking and GIL release only; no model logic. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <time.h>

#include "activations.h"
#include "attention.h"
#include "crc32c.h"
#include "gemm_f32.h"
#include "kda.h"
#include "io.h"
#include "mapguard.h"
#include "matmul.h"
#include "quant_int8.h"
#include "norm.h"
#include "rope.h"

static const char *level_names[MS_NUM_LEVELS] = {"scalar", "avx2", "avx512", "avx512vnni", "avx512vbmi", "amx"};

/* Fills an ms_matrix from Python arguments and checks every size against the buffers. Returns 0, or
 * -1 with a Python exception set. The caller releases the buffers. */
static int make_matrix(int fmt, Py_buffer *w, Py_buffer *s, int has_scales, long long rows, long long cols,
                       ms_matrix *m) {
    if (fmt < 0 || fmt >= MS_NUM_FORMATS) {
        PyErr_Format(PyExc_ValueError, "unknown weight format %d", fmt);
        return -1;
    }
    if (rows <= 0 || cols <= 0) {
        PyErr_SetString(PyExc_ValueError, "rows and cols must be positive");
        return -1;
    }
    const ms_format_traits *t = &ms_formats[fmt];
    if (cols % t->block != 0) {
        PyErr_Format(PyExc_ValueError, "%s: cols %lld is not a multiple of the block size %d", t->name, cols,
                     t->block);
        return -1;
    }
    m->fmt = (ms_format)fmt;
    m->rows = rows;
    m->cols = cols;
    m->row_bytes = cols / t->block * t->block_bytes;
    if (w->len < m->row_bytes * rows) {
        PyErr_Format(PyExc_ValueError, "%s weight buffer has %zd bytes, %lld x %lld needs %lld", t->name, w->len,
                     rows, cols, (long long)(m->row_bytes * rows));
        return -1;
    }
    m->data = (const uint8_t *)w->buf;
    m->scales = NULL;
    if (fmt == MS_FP8_E4M3_B128) {
        long long need = ((rows + 127) / 128) * ((cols + 127) / 128) * (long long)sizeof(float);
        if (!has_scales || s->len < need) {
            PyErr_Format(PyExc_ValueError, "fp8 weight needs a float32 block-scale buffer of %lld bytes", need);
            return -1;
        }
        m->scales = s->buf;
    }
    if (fmt == MS_INT4_G32) {
        long long need = rows * (cols / 32) * (long long)sizeof(float);
        if (!has_scales || s->len < need) {
            PyErr_Format(PyExc_ValueError, "int4 weight needs a float32 group-scale buffer of %lld bytes", need);
            return -1;
        }
        m->scales = s->buf;
    }
    if (fmt == MS_MXFP4) {
        long long need = rows * (cols / 32);
        if (!has_scales || s->len < need) {
            PyErr_Format(PyExc_ValueError, "mxfp4 weight needs a uint8 E8M0 scale buffer of %lld bytes", need);
            return -1;
        }
        m->scales = s->buf;
    }
    return 0;
}

/* The buffers of one matrix while a call runs. */
typedef struct {
    Py_buffer w, s;
    int has_scales;
} matrix_buffers;

static void release_matrix(matrix_buffers *b) {
    PyBuffer_Release(&b->w);
    if (b->has_scales) PyBuffer_Release(&b->s);
}

/* With b->w held: the scales (unless None) held too and m made from both, every size checked. 0, or -1 with a
 * Python exception set and nothing held (b->w released). */
static int hold_matrix(int fmt, PyObject *scales_obj, long long rows, long long cols, matrix_buffers *b,
                       ms_matrix *m) {
    b->has_scales = scales_obj != Py_None;
    if (b->has_scales && PyObject_GetBuffer(scales_obj, &b->s, PyBUF_SIMPLE) < 0) {
        b->has_scales = 0;
        PyBuffer_Release(&b->w);
        return -1;
    }
    if (make_matrix(fmt, &b->w, &b->s, b->has_scales, rows, cols, m) == 0) return 0;
    release_matrix(b);
    return -1;
}

/* The buffers one product holds while it runs. */
typedef struct {
    matrix_buffers m;
    Py_buffer x, out;
} product_buffers;

static void release_product(product_buffers *b) {
    release_matrix(&b->m);
    PyBuffer_Release(&b->x);
    PyBuffer_Release(&b->out);
}

/* A C-contiguous, 4-byte aligned float32 buffer (checked here, so that callers need not check dtypes):
 * 0, or -1 with an exception set and nothing held. */
static int get_f32(PyObject *obj, Py_buffer *b, int writable, const char *name) {
    if (PyObject_GetBuffer(obj, b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    const char *f = b->format ? b->format : "B";
    if (f[0] == '<' || f[0] == '=' || f[0] == '@') f++;
    if (strcmp(f, "f") != 0 || b->itemsize != 4) {
        PyErr_Format(PyExc_ValueError, "%s must be float32, not format '%s'", name, b->format ? b->format : "B");
        PyBuffer_Release(b);
        return -1;
    }
    if ((uintptr_t)b->buf % sizeof(float) != 0) {
        PyErr_Format(PyExc_ValueError, "%s must be 4-byte aligned", name);
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

/* A C-contiguous, 8-byte aligned int64 buffer (writable if asked): 0, or -1 with a ValueError naming it
 * and nothing held. */
static int get_i64(PyObject *obj, Py_buffer *b, int writable, const char *name) {
    if (PyObject_GetBuffer(obj, b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    const char *f = b->format ? b->format : "B";
    if (f[0] == '<' || f[0] == '=' || f[0] == '@') f++;
    if ((strcmp(f, "q") != 0 && strcmp(f, "l") != 0) || b->itemsize != 8 || (uintptr_t)b->buf % 8 != 0) {
        PyErr_Format(PyExc_ValueError, "%s must be aligned int64", name);
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

/* (fmt, w, scales, rows, cols, x, out) -> p with every size checked. 0 with the buffers held (release
 * them with release_product), or -1 with a Python exception set and nothing held. */
static int parse_product(PyObject *args, ms_product *p, product_buffers *b) {
    int fmt;
    long long rows, cols;
    PyObject *scales_obj, *x_obj, *out_obj;
    if (!PyArg_ParseTuple(args, "iy*OLLOO", &fmt, &b->m.w, &scales_obj, &rows, &cols, &x_obj, &out_obj)) return -1;
    if (get_f32(x_obj, &b->x, 0, "x") < 0) {
        PyBuffer_Release(&b->m.w);
        return -1;
    }
    if (get_f32(out_obj, &b->out, 1, "out") < 0) {
        PyBuffer_Release(&b->m.w);
        PyBuffer_Release(&b->x);
        return -1;
    }
    if (hold_matrix(fmt, scales_obj, rows, cols, &b->m, &p->m) < 0) {
        PyBuffer_Release(&b->x);
        PyBuffer_Release(&b->out);
        return -1;
    }
    if (b->x.len % (cols * (Py_ssize_t)sizeof(float)) != 0) {
        PyErr_Format(PyExc_ValueError, "x has %zd bytes, not a whole number of f32 rows of %lld", b->x.len, cols);
        goto fail;
    }
    long long T = b->x.len / (cols * (Py_ssize_t)sizeof(float));
    if (b->out.len != T * rows * (Py_ssize_t)sizeof(float)) {
        PyErr_Format(PyExc_ValueError, "out has %zd bytes, [%lld, %lld] f32 needs %lld", b->out.len, T, rows,
                     T * rows * 4);
        goto fail;
    }
    if (((uintptr_t)b->x.buf | (uintptr_t)b->out.buf) % sizeof(float) != 0) {
        PyErr_SetString(PyExc_ValueError, "x and out must be 4-byte aligned");
        goto fail;
    }
    p->x = (const float *)b->x.buf;
    p->T = T;
    p->out = (float *)b->out.buf;
    return 0;
fail:
    release_product(b);
    return -1;
}

static PyObject *run_products(ms_product *p, int n, int threads) {
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ms_matmul_many(p, n, threads);
    Py_END_ALLOW_THREADS
    if (rc != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* The arguments (fmt, w, scales, rows, cols, x, out, threads, then nargs - 8 more longs into extra) of a call
 * named name: 0, or -1 with the error set (nothing held). */
static int parse_matmul_call(PyObject *args, Py_ssize_t nargs, const char *name, ms_product *p, product_buffers *b,
                             int *threads, long *extra) {
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    if (n != nargs) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", name, nargs, n);
        return -1;
    }
    *threads = PyLong_AsLong(PyTuple_GET_ITEM(args, 7));
    if (*threads == -1 && PyErr_Occurred()) return -1;
    for (Py_ssize_t i = 8; i < nargs; i++) {
        extra[i - 8] = PyLong_AsLong(PyTuple_GET_ITEM(args, i));
        if (extra[i - 8] == -1 && PyErr_Occurred()) return -1;
    }
    PyObject *head = PyTuple_GetSlice(args, 0, 7);
    if (head == NULL) return -1;
    int rc = parse_product(head, p, b);
    Py_DECREF(head);
    return rc < 0 ? -1 : 0;
}

static PyObject *py_matmul(PyObject *self, PyObject *args) {
    (void)self;
    ms_product p;
    product_buffers b;
    int threads;
    if (parse_matmul_call(args, 8, "matmul", &p, &b, &threads, NULL) < 0) return NULL;
    PyObject *ret = run_products(&p, 1, threads);
    release_product(&b);
    return ret;
}

/* matmul(fmt, w, scales, rows, cols, x, out, threads) `repeats` times in C, without the GIL: the seconds of the
 * fastest call. For benchmarks of a matrix that stays in cache, where the Python call costs as much as the
 * kernel. */
static PyObject *py_matmul_repeat(PyObject *self, PyObject *args) {
    (void)self;
    ms_product p;
    product_buffers b;
    int threads, rc = 0;
    long repeats;
    if (parse_matmul_call(args, 9, "matmul_repeat", &p, &b, &threads, &repeats) < 0) return NULL;
    if (repeats < 1) {
        release_product(&b);
        PyErr_SetString(PyExc_ValueError, "matmul_repeat: repeats must be at least 1");
        return NULL;
    }
    double best = 1e300;
    Py_BEGIN_ALLOW_THREADS
    for (long i = 0; i < repeats && rc == 0; i++) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        rc = ms_matmul_many(&p, 1, threads);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        double dt = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
        if (dt < best) best = dt;
    }
    Py_END_ALLOW_THREADS
    release_product(&b);
    if (rc != 0) return PyErr_NoMemory();
    return PyFloat_FromDouble(best);
}

static PyObject *py_matmul_many(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *seq;
    int threads;
    if (!PyArg_ParseTuple(args, "Oi", &seq, &threads)) return NULL;
    PyObject *fast = PySequence_Fast(seq, "matmul_many takes a sequence of products");
    if (fast == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (n > 1 << 20) {
        Py_DECREF(fast);
        PyErr_SetString(PyExc_ValueError, "too many products in one batch");
        return NULL;
    }
    ms_product *p = PyMem_Calloc((size_t)(n ? n : 1), sizeof(ms_product));
    product_buffers *b = PyMem_Calloc((size_t)(n ? n : 1), sizeof(product_buffers));
    PyObject *ret = NULL;
    Py_ssize_t held = 0;
    if (p == NULL || b == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; held < n; held++) {
        PyObject *item = PySequence_Fast_GET_ITEM(fast, held);
        if (!PyTuple_Check(item)) {
            PyErr_SetString(PyExc_TypeError, "each product is a tuple (fmt, w, scales, rows, cols, x, out)");
            goto done;
        }
        if (parse_product(item, &p[held], &b[held]) < 0) goto done;
    }
    ret = run_products(p, (int)n, threads);
done:
    for (Py_ssize_t i = 0; i < held; i++) release_product(&b[i]);
    PyMem_Free(p);
    PyMem_Free(b);
    Py_DECREF(fast);
    return ret;
}

static PyObject *py_dequant(PyObject *self, PyObject *args) {
    (void)self;
    int fmt, threads;
    long long rows, cols;
    Py_buffer w, s, out;
    PyObject *scales_obj;
    if (!PyArg_ParseTuple(args, "iy*OLLw*i", &fmt, &w, &scales_obj, &rows, &cols, &out, &threads)) return NULL;
    int has_scales = scales_obj != Py_None;
    if (has_scales && PyObject_GetBuffer(scales_obj, &s, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&w);
        PyBuffer_Release(&out);
        return NULL;
    }
    ms_matrix m;
    PyObject *ret = NULL;
    if (make_matrix(fmt, &w, &s, has_scales, rows, cols, &m) < 0) goto done;
    if (out.len != rows * cols * (Py_ssize_t)sizeof(float)) {
        PyErr_Format(PyExc_ValueError, "out has %zd bytes, [%lld, %lld] f32 needs %lld", out.len, rows, cols,
                     rows * cols * 4);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    ms_dequant(&m, (float *)out.buf, threads);
    Py_END_ALLOW_THREADS
    ret = Py_None;
    Py_INCREF(ret);
done:
    PyBuffer_Release(&w);
    if (has_scales) PyBuffer_Release(&s);
    PyBuffer_Release(&out);
    return ret;
}

static PyObject *py_memread(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer b;
    int threads, streams = 1;
    if (!PyArg_ParseTuple(args, "y*i|i", &b, &threads, &streams)) return NULL;
    if (streams < 1 || streams > 64) {
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_ValueError, "memread: streams must be 1..64");
        return NULL;
    }
    double r;
    Py_BEGIN_ALLOW_THREADS
    r = ms_memread((const uint8_t *)b.buf, b.len, threads, streams);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    return PyFloat_FromDouble(r);
}

static PyObject *py_get_isa(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyUnicode_FromString(level_names[ms_get_level()]);
}

static PyObject *py_uses_gfni(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyBool_FromLong(ms_use_gfni());
}

static PyObject *py_set_isa(PyObject *self, PyObject *args) {
    (void)self;
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    for (int i = 0; i < MS_NUM_LEVELS; i++) {
        if (strcmp(name, level_names[i]) == 0) {
            if (ms_set_level((ms_level)i) < 0) {
                PyErr_Format(PyExc_ValueError, "this CPU does not support the %s kernels", name);
                return NULL;
            }
            Py_RETURN_NONE;
        }
    }
    PyErr_Format(PyExc_ValueError, "unknown instruction set %s", name);
    return NULL;
}

/* A kernel setting from one int argument: set(value) < 0 refuses it with ValueError(what, value). */
static PyObject *set_setting(PyObject *args, int (*set)(int), const char *what) {
    int value;
    if (!PyArg_ParseTuple(args, "i", &value)) return NULL;
    if (set(value) < 0) {
        PyErr_Format(PyExc_ValueError, "%s, not %d", what, value);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *py_set_weight_streams(PyObject *self, PyObject *args) {
    (void)self;
    return set_setting(args, ms_set_weight_streams, "weight streams must be 0 (automatic), 1 or 4");
}

static PyObject *py_set_q4k_pairs(PyObject *self, PyObject *args) {
    (void)self;
    return set_setting(args, ms_set_q4k_pairs, "q4_k gemm pairs must be 0 (automatic), 1 or 2");
}

static PyObject *py_get_q4k_pairs(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return Py_BuildValue("ii", ms_q4k_pairs_setting(), ms_q4k_pairs() ? 2 : 1);
}

static PyObject *py_set_prefetch_level(PyObject *self, PyObject *args) {
    (void)self;
    return set_setting(args, ms_set_prefetch_level, "the prefetch level must be 1 or 2");
}

static PyObject *py_weight_streams_for(PyObject *self, PyObject *args) {
    (void)self;
    long long x_bytes, run_bytes = 0;
    if (!PyArg_ParseTuple(args, "L|L", &x_bytes, &run_bytes)) return NULL;
    return PyLong_FromLong(ms_weight_streams_for(x_bytes, run_bytes));
}

static PyObject *py_prefetch_into_l2(PyObject *self, PyObject *args) {
    (void)self;
    long long ahead;
    if (!PyArg_ParseTuple(args, "L", &ahead)) return NULL;
    return PyBool_FromLong(ms_prefetch_into_l2(ahead));
}

static PyObject *py_get_weight_streams(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyLong_FromLong(ms_weight_streams());
}

static PyObject *py_get_prefetch_level(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyLong_FromLong(ms_prefetch_level());
}

static PyObject *py_l1d_bytes(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyLong_FromLong(ms_l1d_bytes());
}

static PyObject *py_supported_isas(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    PyObject *l = PyList_New(0);
    if (!l) return NULL;
    for (int i = 0; i < MS_NUM_LEVELS; i++) {
        if (ms_level_supported((ms_level)i)) {
            PyObject *s = PyUnicode_FromString(level_names[i]);
            if (!s || PyList_Append(l, s) < 0) {
                Py_XDECREF(s);
                Py_DECREF(l);
                return NULL;
            }
            Py_DECREF(s);
        }
    }
    return l;
}

static PyObject *py_formats(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    PyObject *l = PyList_New(MS_NUM_FORMATS);
    if (!l) return NULL;
    for (int i = 0; i < MS_NUM_FORMATS; i++) {
        PyObject *t = Py_BuildValue("(sii)", ms_formats[i].name, ms_formats[i].block, ms_formats[i].block_bytes);
        if (!t) {
            Py_DECREF(l);
            return NULL;
        }
        PyList_SET_ITEM(l, i, t);
    }
    return l;
}

static PyObject *py_pread(PyObject *self, PyObject *args) {
    (void)self;
    int fd;
    long long offset, n;
    Py_buffer buf;
    if (!PyArg_ParseTuple(args, "iw*LL", &fd, &buf, &offset, &n)) return NULL;
    if (n < 0 || n > buf.len || offset < 0) {
        PyBuffer_Release(&buf);
        PyErr_Format(PyExc_ValueError, "pread: %lld bytes at %lld into a buffer of %zd", n, offset, buf.len);
        return NULL;
    }
    int64_t r;
    Py_BEGIN_ALLOW_THREADS r = ms_pread_full(fd, buf.buf, n, offset);
    Py_END_ALLOW_THREADS PyBuffer_Release(&buf);
    if (r < 0) {
        errno = (int)-r;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromLongLong(r);
}

/* A kernel's return code as the Python result: None, or NULL with MemoryError for -1 (scratch memory). */
static PyObject *none_unless_out_of_memory(int rc) {
    if (rc != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* A float32 buffer's length must be n floats (n < 0: any). */
static int check_count(const Py_buffer *b, const char *name, long long n) {
    if (n >= 0 && b->len != n * (Py_ssize_t)sizeof(float)) {
        PyErr_Format(PyExc_ValueError, "gqa_decode: %s has %zd bytes, needs %lld float32", name, b->len, n);
        return -1;
    }
    return 0;
}

static PyObject *py_gqa_decode(PyObject *self, PyObject *args) {
    (void)self;
    enum { Q, K, V, KC, VC, COS, SIN, OUT, QN, KN, NBUF };
    static const char *names[NBUF] = {"q", "k", "v", "the key cache", "the value cache", "cos", "sin", "out",
                                      "q_norm", "k_norm"};
    Py_buffer b[NBUF];
    PyObject *obj[NBUF];
    int held[NBUF] = {0};
    ms_gqa_decode_args a;
    long long pos, window;
    int interleave, threads;
    PyObject *ret = NULL;
    if (!PyArg_ParseTuple(args, "OOOOOLiiiOOfOOpfLOi", &obj[Q], &obj[K], &obj[V], &obj[KC], &obj[VC], &pos, &a.H,
                          &a.KV, &a.D, &obj[QN], &obj[KN], &a.eps, &obj[COS], &obj[SIN], &interleave, &a.scaling,
                          &window, &obj[OUT], &threads))
        return NULL;
    for (int i = 0; i < NBUF; i++) {
        if ((i == QN || i == KN) && obj[i] == Py_None) continue;
        if (get_f32(obj[i], &b[i], i == KC || i == VC || i == OUT, names[i]) < 0) goto done;
        held[i] = 1;
    }
    if (a.H <= 0 || a.KV <= 0 || a.D <= 0 || a.H % a.KV != 0 || a.D % 2 != 0) {
        PyErr_Format(PyExc_ValueError, "gqa_decode: %d heads, %d key/value heads, head dim %d do not add up", a.H,
                     a.KV, a.D);
        goto done;
    }
    long long hd = (long long)a.H * a.D, kvd = (long long)a.KV * a.D;
    if (check_count(&b[Q], "q", hd) || check_count(&b[K], "k", kvd) || check_count(&b[V], "v", kvd) ||
        check_count(&b[OUT], "out", hd) || check_count(&b[COS], "cos", a.D / 2) ||
        check_count(&b[SIN], "sin", a.D / 2) ||
        check_count(&b[VC], "the value cache", b[KC].len / (Py_ssize_t)sizeof(float)) ||
        (held[QN] && check_count(&b[QN], "q_norm", a.D)) || (held[KN] && check_count(&b[KN], "k_norm", a.D)))
        goto done;
    a.cap = (long long)(b[KC].len / (Py_ssize_t)sizeof(float)) / kvd;
    if (a.cap * kvd * (Py_ssize_t)sizeof(float) != b[KC].len || pos < 0 || pos >= a.cap || window < 0) {
        PyErr_Format(PyExc_ValueError, "gqa_decode: position %lld (window %lld) in caches of %zd bytes", pos, window,
                     b[KC].len);
        goto done;
    }
    a.pos = pos;
    a.window = window;
    a.interleave = interleave;
    a.q = b[Q].buf;
    a.k = b[K].buf;
    a.v = b[V].buf;
    a.kcache = b[KC].buf;
    a.vcache = b[VC].buf;
    a.cos = b[COS].buf;
    a.sin = b[SIN].buf;
    a.out = b[OUT].buf;
    a.q_norm = held[QN] ? b[QN].buf : NULL;
    a.k_norm = held[KN] ? b[KN].buf : NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ms_gqa_decode(&a, threads);
    Py_END_ALLOW_THREADS
    ret = none_unless_out_of_memory(rc);
done:
    for (int i = 0; i < NBUF; i++)
        if (held[i]) PyBuffer_Release(&b[i]);
    return ret;
}

static PyObject *py_exp_shifted(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *obj;
    float m;
    Py_buffer b;
    if (!PyArg_ParseTuple(args, "Of", &obj, &m)) return NULL;
    if (get_f32(obj, &b, 1, "p") < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    ms_exp_shifted((float *)b.buf, b.len / (Py_ssize_t)sizeof(float), m);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    Py_RETURN_NONE;
}

/* silu_mul(g, u, h, threads): h = silu(g) * u elementwise (float32, h may be g or u) */
static PyObject *py_silu_mul(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *obj[3];
    int threads;
    if (!PyArg_ParseTuple(args, "OOOi", &obj[0], &obj[1], &obj[2], &threads)) return NULL;
    Py_buffer b[3];
    static const char *names[3] = {"g", "u", "h"};
    int held = 0;
    PyObject *ret = NULL;
    for (; held < 3; held++)
        if (get_f32(obj[held], &b[held], held == 2, names[held]) < 0) goto done;
    if (b[1].len != b[0].len || b[2].len != b[0].len) {
        PyErr_Format(PyExc_ValueError, "silu_mul: g of %zd bytes, u of %zd, h of %zd do not add up", b[0].len,
                     b[1].len, b[2].len);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    ms_silu_mul(b[0].buf, b[1].buf, b[2].buf, b[0].len / (Py_ssize_t)sizeof(float), threads);
    Py_END_ALLOW_THREADS
    ret = Py_None;
    Py_INCREF(ret);
done:
    for (int i = 0; i < held; i++) PyBuffer_Release(&b[i]);
    return ret;
}

/* softmax_topk(logits [T, n], k, renormalize, idx int64 [T, k], w [T, k]) */
static PyObject *py_softmax_topk(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *obj[3];
    long long n;
    int k, renormalize;
    if (!PyArg_ParseTuple(args, "OLipOO", &obj[0], &n, &k, &renormalize, &obj[1], &obj[2])) return NULL;
    Py_buffer logits, idx, w;
    PyObject *ret = NULL;
    if (get_f32(obj[0], &logits, 0, "logits") < 0) return NULL;
    if (get_i64(obj[1], &idx, 1, "softmax_topk: idx") < 0) goto release_logits;
    if (get_f32(obj[2], &w, 1, "w") < 0) goto release_idx;
    const long long T = n > 0 ? logits.len / 4 / n : 0;
    if (n <= 0 || k < 1 || k > n || logits.len != T * n * 4 || idx.len != T * k * 8 || w.len != T * k * 4) {
        PyErr_Format(PyExc_ValueError,
                     "softmax_topk: logits of %zd bytes, idx of %zd, w of %zd for %lld experts and k %d do not add up",
                     logits.len, idx.len, w.len, n, k);
        goto release_w;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ms_softmax_topk(logits.buf, T, n, k, renormalize, idx.buf, w.buf);
    Py_END_ALLOW_THREADS
    ret = none_unless_out_of_memory(rc);
release_w:
    PyBuffer_Release(&w);
release_idx:
    PyBuffer_Release(&idx);
release_logits:
    PyBuffer_Release(&logits);
    return ret;
}

/* (fmt, w, scales, rows, cols) -> m with its sizes checked: 0 with the buffers held, or -1 with an exception
 * set and nothing held. */
static int parse_matrix(PyObject *item, ms_matrix *m, matrix_buffers *b) {
    int fmt;
    long long rows, cols;
    PyObject *scales_obj;
    if (!PyTuple_Check(item)) {
        PyErr_SetString(PyExc_TypeError, "each matrix is a tuple (fmt, w, scales, rows, cols)");
        return -1;
    }
    if (!PyArg_ParseTuple(item, "iy*OLL", &fmt, &b->w, &scales_obj, &rows, &cols)) return -1;
    return hold_matrix(fmt, scales_obj, rows, cols, b, m);
}

/* glu_experts([gate_0, up_0, down_0, gate_1, ...], x [cols], w [n] or None, out, threads), each matrix a tuple
 * (fmt, w, scales, rows, cols): see ms_glu_experts_one_x */
static PyObject *py_glu_experts(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *seq, *x_obj, *w_obj, *out_obj;
    int threads;
    if (!PyArg_ParseTuple(args, "OOOOi", &seq, &x_obj, &w_obj, &out_obj, &threads)) return NULL;
    PyObject *fast = PySequence_Fast(seq, "glu_experts takes a sequence of matrices");
    if (fast == NULL) return NULL;
    const Py_ssize_t nm = PySequence_Fast_GET_SIZE(fast);
    const int n = (int)(nm / 3);
    ms_matrix *m = PyMem_Calloc((size_t)(nm ? nm : 1), sizeof(ms_matrix));
    matrix_buffers *b = PyMem_Calloc((size_t)(nm ? nm : 1), sizeof(matrix_buffers));
    Py_buffer x, w, out;
    int has_x = 0, has_w = 0, has_out = 0;
    Py_ssize_t held = 0;
    PyObject *ret = NULL;
    if (m == NULL || b == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (nm == 0 || nm % 3 != 0 || nm > 3 * 4096) {
        PyErr_Format(PyExc_ValueError, "glu_experts: %zd matrices are not (gate, up, down) for 1 to 4096 experts", nm);
        goto done;
    }
    for (; held < nm; held++)
        if (parse_matrix(PySequence_Fast_GET_ITEM(fast, held), &m[held], &b[held]) < 0) goto done;
    if (get_f32(x_obj, &x, 0, "x") < 0) goto done;
    has_x = 1;
    if (w_obj != Py_None) {
        if (get_f32(w_obj, &w, 0, "w") < 0) goto done;
        has_w = 1;
    }
    if (get_f32(out_obj, &out, 1, "out") < 0) goto done;
    has_out = 1;
    const int64_t cols = m[0].cols, inner = m[0].rows, width = m[2].rows;
    for (int i = 0; i < n; i++) {
        const ms_matrix *g = &m[3 * i], *u = &m[3 * i + 1], *d = &m[3 * i + 2];
        if (g->rows != inner || u->rows != inner || g->cols != cols || u->cols != cols || d->cols != inner ||
            d->rows != width) {
            PyErr_Format(PyExc_ValueError,
                         "glu_experts: expert %d is gate [%lld, %lld], up [%lld, %lld], down [%lld, %lld], not "
                         "[%lld, %lld], [%lld, %lld], [%lld, %lld]",
                         i, (long long)g->rows, (long long)g->cols, (long long)u->rows, (long long)u->cols,
                         (long long)d->rows, (long long)d->cols, (long long)inner, (long long)cols,
                         (long long)inner, (long long)cols, (long long)width, (long long)inner);
            goto done;
        }
    }
    const Py_ssize_t want_out = (has_w ? 1 : n) * width * (Py_ssize_t)sizeof(float);
    if (x.len != cols * (Py_ssize_t)sizeof(float) || (has_w && w.len != n * (Py_ssize_t)sizeof(float)) ||
        out.len != want_out) {
        PyErr_Format(PyExc_ValueError,
                     "glu_experts: x of %zd bytes, w of %zd, out of %zd for %d experts of [%lld -> %lld -> %lld] do "
                     "not add up",
                     x.len, has_w ? w.len : (Py_ssize_t)0, out.len, n, (long long)cols, (long long)inner,
                     (long long)width);
        goto done;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ms_glu_experts_one_x(m, n, x.buf, has_w ? w.buf : NULL, out.buf, threads);
    Py_END_ALLOW_THREADS
    ret = none_unless_out_of_memory(rc);
done:
    for (Py_ssize_t i = 0; i < held; i++) release_matrix(&b[i]);
    if (has_x) PyBuffer_Release(&x);
    if (has_w) PyBuffer_Release(&w);
    if (has_out) PyBuffer_Release(&out);
    PyMem_Free(m);
    PyMem_Free(b);
    Py_DECREF(fast);
    return ret;
}

static PyObject *py_rms_norm(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *x_obj, *w_obj, *out_obj;
    float eps;
    if (!PyArg_ParseTuple(args, "OOfO", &x_obj, &w_obj, &eps, &out_obj)) return NULL;
    Py_buffer x, w, out;
    if (get_f32(x_obj, &x, 0, "x") < 0) return NULL;
    if (get_f32(w_obj, &w, 0, "w") < 0) {
        PyBuffer_Release(&x);
        return NULL;
    }
    PyObject *ret = NULL;
    if (get_f32(out_obj, &out, 1, "out") < 0) goto release_xw;
    long long n = (long long)(w.len / 4), rows = n ? (long long)(x.len / 4) / n : 0;
    if (n == 0 || rows * n * 4 != x.len || out.len != x.len) {
        PyErr_Format(PyExc_ValueError, "rms_norm: x of %zd bytes, w of %zd, out of %zd do not add up", x.len, w.len,
                     out.len);
        goto release_all;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ms_rms_norm(x.buf, w.buf, rows, n, eps, out.buf);
    Py_END_ALLOW_THREADS
    ret = none_unless_out_of_memory(rc);
release_all:
    PyBuffer_Release(&out);
release_xw:
    PyBuffer_Release(&w);
    PyBuffer_Release(&x);
    return ret;
}

/* combine_rows (which = 0: coef [H, N] -> out [H, cols]) and block_rows_matmul (which = 1: x [H, cols] ->
 * out [H, N]), blocks of N rows of W from row first, one every stride rows. */
static PyObject *block_rows(PyObject *args, int which) {
    int fmt, H, N, threads;
    long long rows, cols, first, stride;
    Py_buffer w, s, in, out;
    PyObject *scales_obj, *in_obj, *out_obj, *ret = NULL;
    if (!PyArg_ParseTuple(args, "iy*OLLOOLLiii", &fmt, &w, &scales_obj, &rows, &cols, &in_obj, &out_obj, &first,
                          &stride, &H, &N, &threads))
        return NULL;
    const char *name = which ? "block_rows_matmul" : "combine_rows";
    int has_scales = scales_obj != Py_None, held = 0; /* held: in, then out */
    if (has_scales && PyObject_GetBuffer(scales_obj, &s, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&w);
        return NULL;
    }
    ms_matrix m;
    if (make_matrix(fmt, &w, &s, has_scales, rows, cols, &m) < 0) goto done;
    if (get_f32(in_obj, &in, 0, which ? "x" : "coef") < 0) goto done;
    held = 1;
    if (get_f32(out_obj, &out, 1, "out") < 0) goto done;
    held = 2;
    const long long in_len = which ? (long long)H * cols * 4 : (long long)H * N * 4;
    const long long out_len = which ? (long long)H * N * 4 : (long long)H * cols * 4;
    if (H < 0 || N < 0 || first < 0 || stride < N || (H > 0 && first + (H - 1) * stride + N > rows) ||
        in.len != in_len || out.len != out_len) {
        PyErr_Format(PyExc_ValueError,
                     "%s: %d blocks of %d rows from row %lld every %lld in %lld rows, input of %zd bytes, out of %zd "
                     "do not add up",
                     name, H, N, first, stride, rows, in.len, out.len);
        goto done;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = which ? ms_block_rows_matmul(&m, first, stride, H, N, in.buf, out.buf, threads)
               : ms_combine_rows(&m, first, stride, H, N, in.buf, out.buf, threads);
    Py_END_ALLOW_THREADS
    if (rc == -2)
        PyErr_Format(PyExc_ValueError, "%s: fp8 blocks of rows must start at multiples of 128", name);
    else
        ret = none_unless_out_of_memory(rc);
done:
    if (held >= 2) PyBuffer_Release(&out);
    if (held >= 1) PyBuffer_Release(&in);
    if (has_scales) PyBuffer_Release(&s);
    PyBuffer_Release(&w);
    return ret;
}

static PyObject *py_combine_rows(PyObject *self, PyObject *args) {
    (void)self;
    return block_rows(args, 0);
}

static PyObject *py_block_rows_matmul(PyObject *self, PyObject *args) {
    (void)self;
    return block_rows(args, 1);
}

/* rope(x [T, heads, D], cos [T, D/2], sin [T, D/2], T, heads, D, interleave, out [T, heads, D]) */
static PyObject *py_rope(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *obj[4];
    long long T, heads, D;
    int interleave;
    if (!PyArg_ParseTuple(args, "OOOLLLpO", &obj[0], &obj[1], &obj[2], &T, &heads, &D, &interleave, &obj[3]))
        return NULL;
    Py_buffer b[4];
    const char *names[4] = {"x", "cos", "sin", "out"};
    int held = 0;
    PyObject *ret = NULL;
    for (; held < 4; held++)
        if (get_f32(obj[held], &b[held], held == 3, names[held]) < 0) goto release;
    if (T < 0 || heads < 1 || D < 2 || D % 2 || b[0].len != T * heads * D * 4 || b[3].len != b[0].len ||
        b[1].len != T * (D / 2) * 4 || b[2].len != b[1].len) {
        PyErr_Format(PyExc_ValueError,
                     "rope: x of %zd bytes, cos of %zd, sin of %zd, out of %zd for %lld tokens, %lld heads of %lld do "
                     "not add up",
                     b[0].len, b[1].len, b[2].len, b[3].len, T, heads, D);
        goto release;
    }
    if (b[3].buf == b[0].buf) {
        PyErr_SetString(PyExc_ValueError, "rope: out must not be x");
        goto release;
    }
    Py_BEGIN_ALLOW_THREADS
    ms_rope(b[0].buf, T, heads, D, b[1].buf, b[2].buf, interleave, b[3].buf);
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None);
    ret = Py_None;
release:
    while (held-- > 0) PyBuffer_Release(&b[held]);
    return ret;
}

/* moe_combine(ys [N, width], rows int64 [T, k], w [T, k], out [T, width], threads) */
static PyObject *py_moe_combine(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *obj[4];
    long long width, T;
    int k, threads;
    if (!PyArg_ParseTuple(args, "OOOOLLii", &obj[0], &obj[1], &obj[2], &obj[3], &width, &T, &k, &threads)) return NULL;
    Py_buffer ys, rows, w, out;
    PyObject *ret = NULL;
    if (get_f32(obj[0], &ys, 0, "ys") < 0) return NULL;
    if (get_i64(obj[1], &rows, 0, "moe_combine: rows") < 0) goto release_ys;
    if (get_f32(obj[2], &w, 0, "w") < 0) goto release_rows;
    if (get_f32(obj[3], &out, 1, "out") < 0) goto release_w;
    const long long n = width > 0 ? ys.len / 4 / width : 0;
    if (width <= 0 || T < 0 || k < 1 || ys.len != n * width * 4 || rows.len != T * k * 8 || w.len != T * k * 4 ||
        out.len != T * width * 4) {
        PyErr_Format(PyExc_ValueError,
                     "moe_combine: ys of %zd bytes, rows of %zd, w of %zd, out of %zd for width %lld, %lld tokens, "
                     "k %d do not add up",
                     ys.len, rows.len, w.len, out.len, width, T, k);
        goto release_out;
    }
    const int64_t *r = rows.buf;
    for (long long i = 0; i < T * k; i++)
        if (r[i] < 0 || r[i] >= n) {
            PyErr_Format(PyExc_ValueError, "moe_combine: row %lld outside the %lld rows of ys", (long long)r[i], n);
            goto release_out;
        }
    Py_BEGIN_ALLOW_THREADS
    ms_moe_combine(ys.buf, width, r, w.buf, T, k, out.buf, threads);
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None);
    ret = Py_None;
release_out:
    PyBuffer_Release(&out);
release_w:
    PyBuffer_Release(&w);
release_rows:
    PyBuffer_Release(&rows);
release_ys:
    PyBuffer_Release(&ys);
    return ret;
}

static PyObject *py_gemm_f32(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *obj[3];
    long long m, k, n;
    int tb;
    if (!PyArg_ParseTuple(args, "OOOLLLp", &obj[0], &obj[1], &obj[2], &m, &k, &n, &tb)) return NULL;
    static const char *names[3] = {"a", "b", "out"};
    Py_buffer b[3];
    int held = 0;
    PyObject *ret = NULL;
    for (; held < 3; held++)
        if (get_f32(obj[held], &b[held], held == 2, names[held]) < 0) goto done;
    if (m < 0 || k < 0 || n < 0 || b[0].len != m * k * 4 || b[1].len != k * n * 4 || b[2].len != m * n * 4) {
        PyErr_Format(PyExc_ValueError, "gemm_f32: a of %zd bytes, b of %zd, out of %zd for m %lld, k %lld, n %lld",
                     b[0].len, b[1].len, b[2].len, m, k, n);
        goto done;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ms_gemm_f32(b[0].buf, b[1].buf, b[2].buf, m, k, n, tb);
    Py_END_ALLOW_THREADS
    ret = none_unless_out_of_memory(rc);
done:
    while (held > 0) PyBuffer_Release(&b[--held]);
    return ret;
}

static PyObject *py_kda_recurrence(PyObject *self, PyObject *args) {
    (void)self;
    enum { S, Q, K, V, ALPHA, BETA, OUT, NBUF };
    static const char *names[NBUF] = {"S", "q", "k", "v", "alpha", "beta", "out"};
    PyObject *obj[NBUF];
    long long T;
    int H, D, threads;
    if (!PyArg_ParseTuple(args, "OOOOOOOLiii", &obj[S], &obj[Q], &obj[K], &obj[V], &obj[ALPHA], &obj[BETA],
                          &obj[OUT], &T, &H, &D, &threads))
        return NULL;
    Py_buffer b[NBUF];
    int held = 0;
    PyObject *ret = NULL;
    for (; held < NBUF; held++)
        if (get_f32(obj[held], &b[held], held == S || held == OUT, names[held]) < 0) goto done;
    const long long thd = T * H * D;
    int ok = T >= 0 && H >= 0 && D >= 0 && b[S].len == (long long)H * D * D * 4 && b[BETA].len == T * H * 4;
    for (int i = Q; i <= OUT; i++)
        if (i != BETA && b[i].len != thd * 4) ok = 0;
    if (!ok) {
        PyErr_Format(PyExc_ValueError, "kda_recurrence: buffers do not match T %lld, H %d, D %d", T, H, D);
        goto done;
    }
    ms_kda_args a = {b[S].buf, b[Q].buf, b[K].buf, b[V].buf, b[ALPHA].buf, b[BETA].buf, b[OUT].buf, T, H, D};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ms_kda_recurrence(&a, threads);
    Py_END_ALLOW_THREADS
    ret = none_unless_out_of_memory(rc);
done:
    while (held > 0) PyBuffer_Release(&b[--held]);
    return ret;
}

static PyObject *py_crc32c(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *keywords[] = {"buffer", "crc", "portable", NULL};
    Py_buffer buf;
    unsigned long crc = 0;
    int portable = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*|kp", keywords, &buf, &crc, &portable)) return NULL;
    if (crc > 0xFFFFFFFFul) {
        PyBuffer_Release(&buf);
        PyErr_SetString(PyExc_ValueError, "crc32c: crc must be a 32-bit value");
        return NULL;
    }
    uint32_t r;
    Py_BEGIN_ALLOW_THREADS r = portable ? ms_crc32c_portable((uint32_t)crc, buf.buf, (size_t)buf.len)
                                        : ms_crc32c((uint32_t)crc, buf.buf, (size_t)buf.len);
    Py_END_ALLOW_THREADS PyBuffer_Release(&buf);
    return PyLong_FromUnsignedLong(r);
}

static PyObject *py_crc32c_hardware(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyBool_FromLong(ms_crc32c_hardware());
}

static PyObject *py_guard_mapping(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long base, length;
    const char *path;
    if (!PyArg_ParseTuple(args, "KKs", &base, &length, &path)) return NULL;
    int r = ms_mapguard_install();
    if (r < 0) {
        errno = -r;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyBool_FromLong(ms_mapguard_add((uintptr_t)base, (size_t)length, path) == 0);
}

static PyObject *py_unguard_mapping(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long base;
    if (!PyArg_ParseTuple(args, "K", &base)) return NULL;
    ms_mapguard_remove((uintptr_t)base);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"crc32c", (PyCFunction)(void (*)(void))py_crc32c, METH_VARARGS | METH_KEYWORDS,
     "crc32c(buffer, crc=0, portable=False): the CRC-32C (Castagnoli) of the buffer's bytes continuing crc "
     "(GIL released; SSE4.2 where the CPU has it, portable=True: the table-driven path)"},
    {"crc32c_hardware", py_crc32c_hardware, METH_NOARGS, "whether crc32c uses the SSE4.2 instruction here"},
    {"guard_mapping", py_guard_mapping, METH_VARARGS,
     "guard_mapping(base, length, path): installs the SIGBUS handler (once) and names path for a fault in "
     "[base, base + length): one line on stderr and exit 4 (csrc/mapguard.h); False when the registry is full"},
    {"unguard_mapping", py_unguard_mapping, METH_VARARGS, "unguard_mapping(base): forgets the range at base"},
    {"pread", py_pread, METH_VARARGS,
     "pread(fd, buffer, offset, n): read n bytes at offset into buffer (GIL released); returns bytes read"},
    {"matmul", py_matmul, METH_VARARGS,
     "matmul(fmt, w, scales, rows, cols, x, out, threads): out[T, rows] = x[T, cols] @ W.T"},
    {"matmul_repeat", py_matmul_repeat, METH_VARARGS,
     "matmul_repeat(fmt, w, scales, rows, cols, x, out, threads, repeats): matmul repeats times, the fastest call's "
     "seconds"},
    {"matmul_many", py_matmul_many, METH_VARARGS,
     "matmul_many([(fmt, w, scales, rows, cols, x, out), ...], threads): several products in one parallel pass"},
    {"dequant", py_dequant, METH_VARARGS, "dequant(fmt, w, scales, rows, cols, out, threads): W as f32"},
    {"gqa_decode", py_gqa_decode, METH_VARARGS,
     "gqa_decode(q, k, v, kcache, vcache, pos, heads, kv_heads, head_dim, q_norm, k_norm, eps, cos, sin, "
     "interleave, scaling, window, out, threads): one token's attention, its key and value written at pos"},
    {"exp_shifted", py_exp_shifted, METH_VARARGS,
     "exp_shifted(p, m): p = exp(p - m) in place (float32), as decode attention's softmax takes it (csrc/exp_f32.h)"},
    {"rope", py_rope, METH_VARARGS,
     "rope(x, cos, sin, T, heads, D, interleave, out): rotary embedding of x [T, heads, D] by cos, sin [T, D/2], "
     "numpy's float32 steps (csrc/rope.h)"},
    {"moe_combine", py_moe_combine, METH_VARARGS,
     "moe_combine(ys, rows, w, out, width, T, k, threads): out[t] = ys[rows[t, 0]] * w[t, 0] + ys[rows[t, 1]] * "
     "w[t, 1] + ..., numpy's float32 multiplies and adds in top-k order"},
    {"combine_rows", py_combine_rows, METH_VARARGS,
     "combine_rows(fmt, w, scales, rows, cols, coef, out, first, stride, H, N, threads): out[h] = sum over n < N of "
     "coef[h, n] * W[first + h * stride + n] (csrc/matmul.h)"},
    {"block_rows_matmul", py_block_rows_matmul, METH_VARARGS,
     "block_rows_matmul(fmt, w, scales, rows, cols, x, out, first, stride, H, V, threads): out[h] = "
     "x[h] @ W[first + h * stride : first + h * stride + V].T (csrc/matmul.h)"},
    {"gemm_f32", py_gemm_f32, METH_VARARGS,
     "gemm_f32(a, b, out, m, k, n, transpose_b): out[m, n] = a[m, k] @ (b[n, k].T if transpose_b else b[k, n]), "
     "each element one fused multiply-add chain over k in order (the same bits on every instruction set)"},
    {"kda_recurrence", py_kda_recurrence, METH_VARARGS,
     "kda_recurrence(S, q, k, v, alpha, beta, out, T, H, D, threads): Kimi Delta Attention's delta rule over T "
     "tokens, state S [H, D, D] updated in place, out [T, H, D] (csrc/kda.h)"},
    {"silu_mul", py_silu_mul, METH_VARARGS,
     "silu_mul(g, u, h, threads): h = g / (1 + exp(-g)) * u elementwise (float32; exp_f32.h, the same bits on "
     "every instruction set)"},
    {"softmax_topk", py_softmax_topk, METH_VARARGS,
     "softmax_topk(logits, n, k, renormalize, idx, w): per row of logits [T, n], the k largest of its softmax "
     "(ties to the lower index) into idx int64 [T, k] and their probabilities into w [T, k] (csrc/activations.h)"},
    {"glu_experts", py_glu_experts, METH_VARARGS,
     "glu_experts([gate_0, up_0, down_0, ...], x, w, out, threads): one token through n SwiGLU experts, each "
     "matrix (fmt, w, scales, rows, cols); out [width] = sum of w[i] * expert_i(x), or out [n, width] when w "
     "is None (csrc/matmul.h)"},
    {"rms_norm", py_rms_norm, METH_VARARGS,
     "rms_norm(x, w, eps, out): out = w * x / sqrt(mean(x^2) + eps) per row of len(w), numpy's float32 bits"},
    {"memread", py_memread, METH_VARARGS, "memread(buffer, threads, streams=1): read every byte, each thread's share as `streams` interleaved runs "
     "(bandwidth baseline); a checksum that does not depend on streams"},
    {"get_isa", py_get_isa, METH_NOARGS, "the kernel path in use (see set_isa)"},
    {"uses_gfni", py_uses_gfni, METH_NOARGS,
     "whether the kernels split q4_k, q6_k and int4 nibbles with GFNI (the avx512vbmi path on a CPU that has it)"},
    {"set_isa", py_set_isa, METH_VARARGS,
     "set_isa(name): force scalar, avx2, avx512 (integer kernels without VNNI), avx512vnni, avx512vbmi or amx "
     "(q4_k's gemm of 24 tokens or more with AMX-INT8)"},
    {"set_weight_streams", py_set_weight_streams, METH_VARARGS,
     "set_weight_streams(n): runs of rows a thread's decode kernels read at once, 1 or 4, or 0: chosen for "
     "each product (the default; the same bits either way)"},
    {"get_weight_streams", py_get_weight_streams, METH_NOARGS, "the setting of set_weight_streams"},
    {"set_q4k_pairs", py_set_q4k_pairs, METH_VARARGS,
     "set_q4k_pairs(n): the lane sums of how many vpdpbusd each vpdpwssd of q4_k's VNNI gemm takes, 1 or 2, or "
     "0: one on Intel, two elsewhere (the default; the same bits either way)"},
    {"get_q4k_pairs", py_get_q4k_pairs, METH_NOARGS, "(the setting of set_q4k_pairs, the number in use)"},
    {"weight_streams_for", py_weight_streams_for, METH_VARARGS,
     "weight_streams_for(x_bytes, run_bytes=0): the streams of a product whose token's prepared activations take "
     "x_bytes, for a thread's run of run_bytes of its weights"},
    {"set_prefetch_level", py_set_prefetch_level, METH_VARARGS,
     "set_prefetch_level(level): 1, the decode kernels prefetch into L1; 2, those prefetches that reach past a "
     "quarter of the L1 go into L2 (the same bits)"},
    {"get_prefetch_level", py_get_prefetch_level, METH_NOARGS,
     "see set_prefetch_level; 2 where the L1 data cache is under 48 KB, else 1"},
    {"prefetch_into_l2", py_prefetch_into_l2, METH_VARARGS,
     "prefetch_into_l2(ahead): whether the decode kernels' prefetches that many bytes ahead go into L2"},
    {"l1d_bytes", py_l1d_bytes, METH_NOARGS, "the L1 data cache per core as the C library reports it (0: unknown)"},
    {"supported_isas", py_supported_isas, METH_NOARGS, "the kernel paths this CPU supports, the best last"},
    {"formats", py_formats, METH_NOARGS, "the format table: (name, block, block_bytes) per format id"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "moestream._C", "moestream C kernels", -1, methods,
                                       NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__C(void) {
    ms_init();
    PyObject *m = PyModule_Create(&moduledef);
    if (m != NULL && PyModule_AddIntConstant(m, "LONG_RUN_BYTES", (long)ms_long_run_bytes()) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
