/*
 * Byte planes of fixed-size elements, in one pass and without the GIL.
 *
 * split(data, itemsize, out): plane p (byte p of every element) goes to
 *     out[p*n : (p+1)*n], where n = len(data) / itemsize.
 * merge(planes, out): the inverse; planes is a sequence of itemsize buffers of n bytes.
 * split_crc(data, itemsize, out, crc) and merge_crc(planes, out, crc): the same, and also
 *     return the CRC32C of the element bytes (continuing ``crc``), computed while the bytes
 *     are in the CPU cache. Only where CRC32C_AVAILABLE (x86-64 with SSE4.2).
 * crc32c_combine(crc1, crc2, len2): the CRC32C of A + B from CRC(A), CRC(B) and len(B), on
 *     every platform (s3ckpt.format.checksums.combine; its Python fallback is the same
 *     arithmetic, many times slower, and a save calls it hundreds of times with the GIL
 *     held where parts are packed from small items: docs/decisions/0008-thread-mode-gil.md).
 *
 * numpy needs two or more passes over memory for either direction (a strided gather per
 * plane, or a shift and an OR for 16-bit words); these loops read and write every byte
 * once, and the common element sizes (2 and 4 bytes) are written so that compilers
 * vectorize them. s3ckpt.format.byteplanes falls back to numpy where this module is not built.
 *
 * Why the checksum lives here: a compressed load writes every byte of the destination
 * through merge, and must then check the block CRC32Cs of those bytes. As separate passes,
 * the merge writes the destination through the cache and the CRC reads it back from
 * memory; on a virtual machine with modest memory bandwidth that costs more than the CRC
 * instructions. Fused, bf16 elements are merged in registers, checksummed from there and
 * written with non-temporal stores (no read of the destination's old contents), while
 * other sizes are merged in cache-sized chunks that are checksummed right after.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_ITEMSIZE 16

/* Called with a constant itemsize, so that the inner loop unrolls and the outer one
 * vectorizes; the generic call handles the other sizes. */
/* Elements [first, first + n) of a split whose planes are ``stride`` bytes apart. */
static inline void split_planes(const uint8_t *restrict data, uint8_t *restrict out,
                                Py_ssize_t first, Py_ssize_t n, Py_ssize_t stride,
                                Py_ssize_t itemsize) {
    for (Py_ssize_t i = first; i < first + n; i++)
        for (Py_ssize_t p = 0; p < itemsize; p++) out[p * stride + i] = data[i * itemsize + p];
}

static inline void merge_planes(const uint8_t *const *planes, uint8_t *restrict out,
                                Py_ssize_t first, Py_ssize_t n, Py_ssize_t itemsize) {
    for (Py_ssize_t i = first; i < first + n; i++)
        for (Py_ssize_t p = 0; p < itemsize; p++) out[i * itemsize + p] = planes[p][i];
}

static void split_any(const uint8_t *data, uint8_t *out, Py_ssize_t first, Py_ssize_t n,
                      Py_ssize_t stride, Py_ssize_t itemsize) {
    switch (itemsize) {
    case 2: split_planes(data, out, first, n, stride, 2); break;
    case 4: split_planes(data, out, first, n, stride, 4); break;
    case 8: split_planes(data, out, first, n, stride, 8); break;
    default: split_planes(data, out, first, n, stride, itemsize);
    }
}

static void merge_any(const uint8_t *const *planes, uint8_t *out, Py_ssize_t first,
                      Py_ssize_t n, Py_ssize_t itemsize) {
    switch (itemsize) {
    case 2: merge_planes(planes, out, first, n, 2); break;
    case 4: merge_planes(planes, out, first, n, 4); break;
    case 8: merge_planes(planes, out, first, n, 8); break;
    default: merge_planes(planes, out, first, n, itemsize);
    }
}

/* ---- CRC32C (Castagnoli) with the SSE4.2 instruction, three streams at a time ---------- */

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_CRC32C 1
#include <immintrin.h>

#define POLY 0x82f63b78u /* reflected */
#define LONG 8192        /* bytes per stream in long runs */
#define SHORT 256        /* bytes per stream in short runs */
#define CHUNK 8192       /* elements merged or split between two checksum steps */
#define NT_MIN (256 * 1024) /* outputs smaller than this stay in the cache */

/* crc_long[k][b]: the CRC of byte b at position k of a word followed by LONG zero bytes,
 * so that three streams' CRCs can be combined (Mark Adler's crc32c.c, zlib license). */
static uint32_t crc_long[4][256], crc_short[4][256];
static int crc_ready;

static uint32_t gf2_times(const uint32_t *mat, uint32_t vec) {
    uint32_t sum = 0;
    for (; vec; vec >>= 1, mat++)
        if (vec & 1) sum ^= *mat;
    return sum;
}

static void gf2_square(uint32_t *square, const uint32_t *mat) {
    for (int n = 0; n < 32; n++) square[n] = gf2_times(mat, mat[n]);
}

/* The operator that appends len zero bytes (len a power of two) to a CRC. */
static void zeros_operator(uint32_t *even, size_t len) {
    uint32_t odd[32], row = 1;
    odd[0] = POLY; /* one zero bit */
    for (int n = 1; n < 32; n++, row <<= 1) odd[n] = row;
    gf2_square(even, odd); /* two bits */
    gf2_square(odd, even); /* four bits */
    do {
        gf2_square(even, odd);
        len >>= 1;
        if (len == 0) return;
        gf2_square(odd, even);
        len >>= 1;
    } while (len);
    memcpy(even, odd, sizeof odd);
}

static void zeros_table(uint32_t zeros[][256], size_t len) {
    uint32_t op[32];
    zeros_operator(op, len);
    for (uint32_t n = 0; n < 256; n++)
        for (int k = 0; k < 4; k++) zeros[k][n] = gf2_times(op, n << (8 * k));
}

static inline uint32_t crc_shift(uint32_t zeros[][256], uint32_t crc) {
    return zeros[0][crc & 0xff] ^ zeros[1][(crc >> 8) & 0xff] ^ zeros[2][(crc >> 16) & 0xff] ^
           zeros[3][crc >> 24];
}

static inline uint64_t load64(const uint8_t *p) {
    uint64_t word;
    memcpy(&word, p, 8);
    return word;
}

/* One crc32 instruction has a latency of three cycles but a throughput of one: three
 * independent streams keep it busy, and their CRCs are combined with the tables above. */
#define CRC_RUNS(stride, table)                                                               \
    while (len >= 3 * (stride)) {                                                             \
        uint64_t crc1 = 0, crc2 = 0;                                                          \
        for (const uint8_t *end = next + (stride); next < end; next += 8) {                   \
            crc0 = _mm_crc32_u64(crc0, load64(next));                                         \
            crc1 = _mm_crc32_u64(crc1, load64(next + (stride)));                              \
            crc2 = _mm_crc32_u64(crc2, load64(next + 2 * (stride)));                          \
        }                                                                                     \
        crc0 = crc_shift(table, (uint32_t)crc0) ^ crc1;                                       \
        crc0 = crc_shift(table, (uint32_t)crc0) ^ crc2;                                       \
        next += 2 * (stride);                                                                 \
        len -= 3 * (size_t)(stride);                                                          \
    }

__attribute__((target("sse4.2"))) static uint32_t crc32c(uint32_t crc, const uint8_t *next,
                                                         size_t len) {
    uint64_t crc0 = crc ^ 0xffffffffu;
    for (; len && ((uintptr_t)next & 7); len--) crc0 = _mm_crc32_u8((uint32_t)crc0, *next++);
    CRC_RUNS(LONG, crc_long)
    CRC_RUNS(SHORT, crc_short)
    for (; len >= 8; len -= 8, next += 8) crc0 = _mm_crc32_u64(crc0, load64(next));
    for (; len; len--) crc0 = _mm_crc32_u8((uint32_t)crc0, *next++);
    return (uint32_t)crc0 ^ 0xffffffffu;
}

#define CRC_VECTOR(crc, v)                                                                    \
    crc = _mm_crc32_u64(crc, (uint64_t)_mm_cvtsi128_si64(v));                                 \
    crc = _mm_crc32_u64(crc, (uint64_t)_mm_extract_epi64(v, 1))

/* Two planes into bf16/fp16 elements: three runs of LONG output bytes at a time, each
 * 16-byte vector checksummed from its register and stored around the cache. */
__attribute__((target("sse4.2"))) static uint32_t merge2_crc(const uint8_t *lo,
                                                             const uint8_t *hi, uint8_t *out,
                                                             Py_ssize_t n, uint32_t crc) {
    const Py_ssize_t run = LONG / 2; /* elements per stream */
    Py_ssize_t i = 0;
    for (; i < n && ((uintptr_t)(out + 2 * i) & 15); i++) { /* align the stores */
        out[2 * i] = lo[i];
        out[2 * i + 1] = hi[i];
        crc = crc32c(crc, out + 2 * i, 2);
    }
    uint64_t crc0 = crc ^ 0xffffffffu;
    for (; n - i >= 3 * run; i += 3 * run) {
        uint64_t crc1 = 0, crc2 = 0;
        const uint8_t *l = lo + i, *h = hi + i;
        uint8_t *o = out + 2 * i;
        for (Py_ssize_t j = 0; j < run; j += 16) {
            __m128i a0 = _mm_loadu_si128((const __m128i *)(l + j));
            __m128i b0 = _mm_loadu_si128((const __m128i *)(h + j));
            __m128i a1 = _mm_loadu_si128((const __m128i *)(l + run + j));
            __m128i b1 = _mm_loadu_si128((const __m128i *)(h + run + j));
            __m128i a2 = _mm_loadu_si128((const __m128i *)(l + 2 * run + j));
            __m128i b2 = _mm_loadu_si128((const __m128i *)(h + 2 * run + j));
            __m128i x0 = _mm_unpacklo_epi8(a0, b0), y0 = _mm_unpackhi_epi8(a0, b0);
            __m128i x1 = _mm_unpacklo_epi8(a1, b1), y1 = _mm_unpackhi_epi8(a1, b1);
            __m128i x2 = _mm_unpacklo_epi8(a2, b2), y2 = _mm_unpackhi_epi8(a2, b2);
            _mm_stream_si128((__m128i *)(o + 2 * j), x0);
            _mm_stream_si128((__m128i *)(o + 2 * j + 16), y0);
            _mm_stream_si128((__m128i *)(o + LONG + 2 * j), x1);
            _mm_stream_si128((__m128i *)(o + LONG + 2 * j + 16), y1);
            _mm_stream_si128((__m128i *)(o + 2 * LONG + 2 * j), x2);
            _mm_stream_si128((__m128i *)(o + 2 * LONG + 2 * j + 16), y2);
            CRC_VECTOR(crc0, x0);
            CRC_VECTOR(crc1, x1);
            CRC_VECTOR(crc2, x2);
            CRC_VECTOR(crc0, y0);
            CRC_VECTOR(crc1, y1);
            CRC_VECTOR(crc2, y2);
        }
        crc0 = crc_shift(crc_long, (uint32_t)crc0) ^ crc1;
        crc0 = crc_shift(crc_long, (uint32_t)crc0) ^ crc2;
    }
    _mm_sfence(); /* the stores are visible before another thread reads the output */
    const uint8_t *planes[2] = {lo, hi};
    merge_any(planes, out, i, n - i, 2);
    return crc32c((uint32_t)crc0 ^ 0xffffffffu, out + 2 * i, (size_t)(n - i) * 2);
}

static uint32_t merge_with_crc(const uint8_t *const *planes, uint8_t *out, Py_ssize_t n,
                               Py_ssize_t itemsize, uint32_t crc) {
    if (itemsize == 2 && n * 2 >= NT_MIN) return merge2_crc(planes[0], planes[1], out, n, crc);
    for (Py_ssize_t i = 0; i < n; i += CHUNK) {
        Py_ssize_t m = n - i < CHUNK ? n - i : CHUNK;
        merge_any(planes, out, i, m, itemsize);
        crc = crc32c(crc, out + i * itemsize, (size_t)(m * itemsize));
    }
    return crc;
}

static uint32_t split_with_crc(const uint8_t *data, uint8_t *out, Py_ssize_t n,
                               Py_ssize_t itemsize, uint32_t crc) {
    for (Py_ssize_t i = 0; i < n; i += CHUNK) {
        Py_ssize_t m = n - i < CHUNK ? n - i : CHUNK;
        crc = crc32c(crc, data + i * itemsize, (size_t)(m * itemsize));
        split_any(data, out, i, m, n, itemsize);
    }
    return crc;
}
#endif /* HAVE_CRC32C */

/* ---- Python functions --------------------------------------------------------------- */

/* Checks split's arguments; 0 with an exception set if they do not fit together. */
static int split_args_ok(const Py_buffer *data, Py_ssize_t itemsize, const Py_buffer *out) {
    if (itemsize < 1 || itemsize > MAX_ITEMSIZE || data->len % itemsize) {
        PyErr_Format(PyExc_ValueError, "%zd bytes are not whole elements of %zd bytes (1 to %d)",
                     data->len, itemsize, MAX_ITEMSIZE);
        return 0;
    }
    if (out->len != data->len) {
        PyErr_Format(PyExc_ValueError, "output has %zd bytes, expected %zd", out->len,
                     data->len);
        return 0;
    }
    return 1;
}

/* Holds the buffers of merge's planes for the length of a call. */
typedef struct {
    Py_buffer views[MAX_ITEMSIZE];
    const uint8_t *planes[MAX_ITEMSIZE];
    Py_ssize_t held, itemsize, n;
} Planes;

static void planes_release(Planes *planes) {
    for (Py_ssize_t i = 0; i < planes->held; i++) PyBuffer_Release(&planes->views[i]);
    planes->held = 0;
}

/* Takes the buffers of ``sequence`` as the planes of ``out``; 0 with an exception set if
 * they do not fit (nothing is then held). */
static int planes_acquire(Planes *planes, PyObject *sequence, const Py_buffer *out) {
    planes->held = 0;
    PyObject *items = PySequence_Fast(sequence, "planes must be a sequence of buffers");
    if (items == NULL) return 0;
    Py_ssize_t itemsize = PySequence_Fast_GET_SIZE(items);
    planes->itemsize = itemsize;
    if (itemsize < 1 || itemsize > MAX_ITEMSIZE || out->len % itemsize) {
        PyErr_Format(PyExc_ValueError, "%zd planes cannot fill %zd bytes (1 to %d planes)",
                     itemsize, out->len, MAX_ITEMSIZE);
        goto fail;
    }
    planes->n = out->len / itemsize;
    for (; planes->held < itemsize; planes->held++) {
        Py_ssize_t p = planes->held;
        Py_buffer *view = &planes->views[p];
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(items, p), view, PyBUF_SIMPLE) < 0)
            goto fail;
        planes->planes[p] = view->buf;
        if (view->len != planes->n) {
            PyErr_Format(PyExc_ValueError, "plane %zd has %zd bytes, expected %zd", p,
                         view->len, planes->n);
            planes->held++;
            goto fail;
        }
    }
    Py_DECREF(items);
    return 1;
fail:
    planes_release(planes);
    Py_DECREF(items);
    return 0;
}

/* split and split_crc: the planes of data's elements into out; with_crc also returns the
 * CRC32C of data continuing the given value. */
static PyObject *split_call(PyObject *args, int with_crc) {
    Py_buffer data, out;
    Py_ssize_t itemsize;
    unsigned int crc = 0;
    int parsed = with_crc ? PyArg_ParseTuple(args, "y*nw*I", &data, &itemsize, &out, &crc)
                          : PyArg_ParseTuple(args, "y*nw*", &data, &itemsize, &out);
    if (!parsed) return NULL;
    PyObject *result = NULL;
    if (split_args_ok(&data, itemsize, &out)) {
        const uint8_t *src = data.buf;
        uint8_t *dst = out.buf;
        Py_ssize_t n = data.len / itemsize;
        uint32_t value = crc;
        Py_BEGIN_ALLOW_THREADS
#ifdef HAVE_CRC32C
        if (with_crc)
            value = split_with_crc(src, dst, n, itemsize, crc);
        else
#endif
            split_any(src, dst, 0, n, n, itemsize);
        Py_END_ALLOW_THREADS
        result = with_crc ? PyLong_FromUnsignedLong(value) : Py_NewRef(Py_None);
    }
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    return result;
}

/* merge and merge_crc: the elements whose byte p comes from planes[p] into out; with_crc
 * also returns the CRC32C of the merged bytes continuing the given value. */
static PyObject *merge_call(PyObject *args, int with_crc) {
    PyObject *sequence;
    Py_buffer out;
    unsigned int crc = 0;
    Planes planes;
    int parsed = with_crc ? PyArg_ParseTuple(args, "Ow*I", &sequence, &out, &crc)
                          : PyArg_ParseTuple(args, "Ow*", &sequence, &out);
    if (!parsed) return NULL;
    PyObject *result = NULL;
    if (planes_acquire(&planes, sequence, &out)) {
        uint8_t *dst = out.buf;
        uint32_t value = crc;
        Py_BEGIN_ALLOW_THREADS
#ifdef HAVE_CRC32C
        if (with_crc)
            value = merge_with_crc(planes.planes, dst, planes.n, planes.itemsize, crc);
        else
#endif
            merge_any(planes.planes, dst, 0, planes.n, planes.itemsize);
        Py_END_ALLOW_THREADS
        planes_release(&planes);
        result = with_crc ? PyLong_FromUnsignedLong(value) : Py_NewRef(Py_None);
    }
    PyBuffer_Release(&out);
    return result;
}

static PyObject *split(PyObject *self, PyObject *args) {
    (void)self;
    return split_call(args, 0);
}

static PyObject *merge(PyObject *self, PyObject *args) {
    (void)self;
    return merge_call(args, 0);
}

#ifdef HAVE_CRC32C
static PyObject *split_crc(PyObject *self, PyObject *args) {
    (void)self;
    return split_call(args, 1);
}

static PyObject *merge_crc(PyObject *self, PyObject *args) {
    (void)self;
    return merge_call(args, 1);
}
#endif

#ifdef HAVE_CRC32C
/* block_crcs(buffers, block_size, release_at): per buffer, the tuple of CRC32Cs of its
 * block_size blocks (an empty buffer has one, of no bytes). Every buffer is checksummed in
 * one pass with the GIL released once, where the buffers hold release_at bytes or more;
 * below that the GIL is kept, since handing it back and forth costs a thread beside a
 * training loop more than checksumming a few small buffers. */
static PyObject *block_crcs(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *sequence, *fast, *result = NULL;
    Py_ssize_t block_size, release_at, count, blocks = 0, total = 0, done = 0;
    if (!PyArg_ParseTuple(args, "Onn", &sequence, &block_size, &release_at)) return NULL;
    if (block_size < 1) {
        PyErr_SetString(PyExc_ValueError, "block_size must be positive");
        return NULL;
    }
    fast = PySequence_Fast(sequence, "block_crcs takes a sequence of buffers");
    if (fast == NULL) return NULL;
    count = PySequence_Fast_GET_SIZE(fast);
    Py_buffer *views = PyMem_Calloc(count ? (size_t)count : 1, sizeof(Py_buffer));
    uint32_t *crcs = NULL;
    if (views == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    for (; done < count; done++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, done), &views[done],
                               PyBUF_SIMPLE) < 0)
            goto out;
        total += views[done].len;
        blocks += views[done].len ? (views[done].len - 1) / block_size + 1 : 1;
    }
    crcs = PyMem_Malloc((size_t)blocks * sizeof(uint32_t));
    if (crcs == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    PyThreadState *state = total >= release_at ? PyEval_SaveThread() : NULL;
    uint32_t *next = crcs;
    for (Py_ssize_t i = 0; i < count; i++) {
        const uint8_t *data = views[i].buf;
        Py_ssize_t length = views[i].len, start = 0;
        do {
            Py_ssize_t size = length - start < block_size ? length - start : block_size;
            *next++ = crc32c(0, data + start, (size_t)size);
            start += size;
        } while (start < length);
    }
    if (state != NULL) PyEval_RestoreThread(state);
    result = PyList_New(count);
    next = crcs;
    for (Py_ssize_t i = 0; result != NULL && i < count; i++) {
        Py_ssize_t n = views[i].len ? (views[i].len - 1) / block_size + 1 : 1;
        PyObject *tuple = PyTuple_New(n);
        for (Py_ssize_t k = 0; tuple != NULL && k < n; k++) {
            PyObject *value = PyLong_FromUnsignedLong(*next++);
            if (value == NULL) Py_CLEAR(tuple);
            else PyTuple_SET_ITEM(tuple, k, value);
        }
        if (tuple == NULL) Py_CLEAR(result);
        else PyList_SET_ITEM(result, i, tuple);
    }
out:
    for (Py_ssize_t i = 0; i < done; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(crcs);
    Py_DECREF(fast);
    return result;
}
#endif

/* ---- CRC32C combination (zlib's crc32_combine for the Castagnoli polynomial) ---------- */

#define CRC32C_POLY 0x82F63B78u /* reflected */

/* a * b modulo the polynomial, both bit-reflected */
static uint32_t combine_multiply(uint32_t a, uint32_t b) {
    uint32_t product = 0, bit = 1u << 31;
    while (a) {
        if (a & bit) {
            product ^= b;
            a ^= bit;
        }
        bit >>= 1;
        b = (b & 1) ? (b >> 1) ^ CRC32C_POLY : b >> 1;
    }
    return product;
}

/* x^(2^k) modulo the Castagnoli polynomial repeats every 31 steps (x^(2^31) = x), not every
 * 32 as for zlib's polynomial: zlib's "k & 31" would pick the wrong power from 2^29 bytes on. */
#define COMBINE_CYCLE 31
static uint32_t combine_x2n[COMBINE_CYCLE]; /* x^(2^k) modulo the polynomial */

static void combine_x2n_init(void) {
    uint32_t power = 1u << 30; /* x^1 */
    for (int k = 0; k < COMBINE_CYCLE; k++) {
        combine_x2n[k] = power;
        power = combine_multiply(power, power);
    }
}

/* x^(8 length) modulo the polynomial */
static uint32_t combine_shift(unsigned long long length) {
    uint32_t power = 1u << 31; /* x^0 */
    for (unsigned k = 3; length; length >>= 1, k++)
        if (length & 1) power = combine_multiply(combine_x2n[k % COMBINE_CYCLE], power);
    return power;
}

/* a CRC32C value from any Python integer (or __index__): OverflowError or ValueError
 * outside 0..2^32-1 */
static int crc_value(PyObject *object, uint32_t *out) {
    PyObject *index = PyNumber_Index(object);
    if (index == NULL) return 0;
    unsigned long long value = PyLong_AsUnsignedLongLong(index);
    Py_DECREF(index);
    if (value == (unsigned long long)-1 && PyErr_Occurred()) return 0;
    if (value > 0xFFFFFFFFull) {
        PyErr_SetString(PyExc_ValueError, "CRC32C values are 32-bit");
        return 0;
    }
    *out = (uint32_t)value;
    return 1;
}

static PyObject *crc32c_combine(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *crc1, *crc2;
    Py_ssize_t length2;
    uint32_t a, b;
    if (!PyArg_ParseTuple(args, "OOn", &crc1, &crc2, &length2)) return NULL;
    if (!crc_value(crc1, &a) || !crc_value(crc2, &b)) return NULL;
    if (length2 < 0) {
        PyErr_SetString(PyExc_ValueError, "lengths are not negative");
        return NULL;
    }
    uint32_t combined =
        a == 0 ? b : combine_multiply(combine_shift((unsigned long long)length2), a) ^ b;
    return PyLong_FromUnsignedLong(combined);
}

static PyMethodDef methods[] = {
    {"crc32c_combine", crc32c_combine, METH_VARARGS,
     "crc32c_combine(crc1, crc2, len2) -> the CRC32C of A + B from CRC(A), CRC(B), len(B)."},
    {"split", split, METH_VARARGS,
     "split(data, itemsize, out): byte p of every element to out[p*n:(p+1)*n]."},
    {"merge", merge, METH_VARARGS,
     "merge(planes, out): the inverse of split; planes holds itemsize buffers of n bytes."},
#ifdef HAVE_CRC32C
    {"split_crc", split_crc, METH_VARARGS,
     "split_crc(data, itemsize, out, crc) -> CRC32C of data continuing crc, while splitting."},
    {"merge_crc", merge_crc, METH_VARARGS,
     "merge_crc(planes, out, crc) -> CRC32C of the merged bytes continuing crc."},
    {"block_crcs", block_crcs, METH_VARARGS,
     "block_crcs(buffers, block_size, release_at) -> per buffer, its blocks' CRC32Cs."},
#endif
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_byteplanes",
    "Byte planes of fixed-size elements, split and merged in one pass without the GIL.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__byteplanes(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    combine_x2n_init();
    int available = 0;
#ifdef HAVE_CRC32C
    __builtin_cpu_init();
    available = __builtin_cpu_supports("sse4.2") != 0;
    if (available && !crc_ready) {
        zeros_table(crc_long, LONG);
        zeros_table(crc_short, SHORT);
        crc_ready = 1;
    }
#endif
    if (PyModule_AddIntConstant(m, "CRC32C_AVAILABLE", available) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
