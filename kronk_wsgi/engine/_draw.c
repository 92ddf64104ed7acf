/* Drawing the next token from a whole vocabulary's logits, filters included, in a few passes.
 *
 * The tokens' order is by logit, highest first, ties by lower id. Each token weighs
 * exp((logit - max) / temperature). top_k, top_p and min_p each keep a first part of that
 * order (top_p and min_p over the top_k tokens' renormalised probabilities); the token is
 * drawn from the shortest of those parts, in proportion to its weight. Finding a part's end
 * sorts only the tokens of one histogram bin of log-weights, never the vocabulary.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdlib.h>

#define BLOCK 256           /* weights summed together: the draw walks block sums, then one block */
#define BINS_PER_UNIT 32    /* histogram bins per unit of log-weight */
#define BINS (96 * BINS_PER_UNIT)  /* exp(-96) is 0 in float32: lighter tokens are in no bin */

/* An AVX2 copy of the vectorised passes beside the baseline one, chosen when the module loads (ifunc). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__GLIBC__)
#define FAST_PATHS __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define FAST_PATHS
#endif

/* exp(x) for x <= 0 (NaN counts as -inf): 0 below -87, else within 2 ulp; branch-free, so it vectorises. */
static inline float exp_nonpositive(float x) {
    float clamped = x > -87.0f ? x : -87.0f;  /* also NaN -> -87 */
    float n = __builtin_roundf(clamped * 1.44269504088896341f);
    float r = clamped - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int bits = ((int)n + 127) << 23;
    float scale;
    __builtin_memcpy(&scale, &bits, sizeof scale);
    float value = p * scale;
    return x > -87.0f ? value : 0.0f;
}

static float max_logit(const float *logits, Py_ssize_t n) FAST_PATHS;
static float max_logit(const float *logits, Py_ssize_t n) {
    enum { LANES = 16 };  /* running maxima side by side, so the loop vectorises */
    float lanes[LANES], best = -INFINITY;
    for (int k = 0; k < LANES; k++)
        lanes[k] = -INFINITY;
    Py_ssize_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int k = 0; k < LANES; k++)
            lanes[k] = logits[i + k] > lanes[k] ? logits[i + k] : lanes[k];
    for (; i < n; i++)
        best = logits[i] > best ? logits[i] : best;
    for (int k = 0; k < LANES; k++)
        best = lanes[k] > best ? lanes[k] : best;
    return best;
}

/* weights[i] = exp((logits[i] - best) * inv_t); block_sums[b] = the sum of block b's weights. */
static void weigh(const float *logits, Py_ssize_t n, float best, float inv_t, float *weights,
                  double *block_sums) FAST_PATHS;
static void weigh(const float *logits, Py_ssize_t n, float best, float inv_t, float *weights, double *block_sums) {
    for (Py_ssize_t start = 0; start < n; start += BLOCK) {
        Py_ssize_t end = start + BLOCK < n ? start + BLOCK : n;
        float sum = 0.0f;
        for (Py_ssize_t i = start; i < end; i++) {
            float w = exp_nonpositive((logits[i] - best) * inv_t);
            weights[i] = w;
            sum += w;
        }
        block_sums[start / BLOCK] = sum;
    }
}

/* The index drawn at u (0 <= u < 1) of the cumulative weights; -1 if all weights are 0. */
static Py_ssize_t walk(const float *weights, Py_ssize_t n, const double *block_sums, double u) {
    Py_ssize_t blocks = (n + BLOCK - 1) / BLOCK, block = 0;
    double total = 0.0, before = 0.0;
    for (Py_ssize_t b = 0; b < blocks; b++)
        total += block_sums[b];
    if (!(total > 0.0))
        return -1;
    double target = u * total;
    while (block < blocks - 1 && before + block_sums[block] <= target)
        before += block_sums[block++];
    /* Rounding may leave the target past the block's own running sum: its last token of weight > 0. */
    Py_ssize_t start = block * BLOCK, end = start + BLOCK < n ? start + BLOCK : n, last = -1;
    for (Py_ssize_t i = start; i < end; i++) {
        if (weights[i] > 0.0f) {
            last = i;
            before += weights[i];
            if (before > target)
                return i;
        }
    }
    if (last < 0)  /* the target fell past every block of weight (rounding): the last token of weight > 0 */
        for (Py_ssize_t i = n - 1; i >= 0 && last < 0; i--)
            if (weights[i] > 0.0f)
                last = i;
    return last;
}

/* Where the filters end the kept part of the order: its last token's logit and id, and
 * whether tokens of the same logit come after it (they are dropped). */
typedef struct { float logit; Py_ssize_t index; int tied; } Cut;

static int kept(Cut cut, float logit, Py_ssize_t index) {
    return logit > cut.logit || (logit == cut.logit && index <= cut.index);
}

/* A token that may end up at a cut, with its histogram bin by log-weight (0 for the heaviest). */
typedef struct { float logit; float weight; Py_ssize_t index; int bin; } Candidate;

static int before_in_order(const void *a, const void *b) {
    const Candidate *x = a, *y = b;
    if (x->logit != y->logit)
        return x->logit > y->logit ? -1 : 1;
    return x->index < y->index ? -1 : (x->index > y->index);
}

/* How many tokens weigh at least ``lightest``, and their weight. */
static void head(const float *weights, Py_ssize_t n, float lightest, Py_ssize_t *count, double *mass) FAST_PATHS;
static void head(const float *weights, Py_ssize_t n, float lightest, Py_ssize_t *count, double *mass) {
    Py_ssize_t c = 0;
    float m = 0.0f;
    for (Py_ssize_t i = 0; i < n; i++) {
        int in = weights[i] >= lightest;
        c += in;
        m += in ? weights[i] : 0.0f;
    }
    *count = c;
    *mass = m;
}

/* Zero the weights of tokens lighter than ``lightest`` or past ``cut``, and sum each block again. */
static void drop(const float *logits, float *weights, Py_ssize_t n, float lightest, Cut cut, double *block_sums) FAST_PATHS;
static void drop(const float *logits, float *weights, Py_ssize_t n, float lightest, Cut cut, double *block_sums) {
    if (cut.tied)  /* tokens of the cut's logit after it in the order */
        for (Py_ssize_t i = cut.index + 1; i < n; i++)
            if (logits[i] == cut.logit)
                weights[i] = 0.0f;
    for (Py_ssize_t start = 0; start < n; start += BLOCK) {
        Py_ssize_t end = start + BLOCK < n ? start + BLOCK : n;
        float sum = 0.0f;
        for (Py_ssize_t i = start; i < end; i++) {
            float w = weights[i] >= lightest && logits[i] >= cut.logit ? weights[i] : 0.0f;
            weights[i] = w;
            sum += w;
        }
        block_sums[start / BLOCK] = sum;
    }
}

/* The candidate at which a running count (by_mass 0) or mass (1) of the ordered candidates first
 * reaches goal, not past ``limit``: 1 and ``*cut`` if there is one, 0 if not, -1 if memory ran out. */
static int find_cut(const Candidate *candidates, Py_ssize_t m, const Py_ssize_t *counts, const double *masses,
                    int by_mass, double goal, Cut limit, Cut *cut, double *mass_to_cut) {
    double reached = 0.0, mass = 0.0;
    int bin = 0;
    for (; bin < BINS; bin++) {
        double step = by_mass ? masses[bin] : (double)counts[bin];
        if (counts[bin] && reached + step >= goal)
            break;
        reached += step;
        mass += masses[bin];
    }
    if (bin == BINS)
        return 0;
    Candidate *members = PyMem_RawMalloc(sizeof(Candidate) * (size_t)counts[bin]);
    if (members == NULL)
        return -1;
    Py_ssize_t size = 0;
    for (Py_ssize_t k = 0; k < m; k++)
        if (candidates[k].bin == bin)
            members[size++] = candidates[k];
    qsort(members, (size_t)size, sizeof(Candidate), before_in_order);
    int found = 0;
    for (Py_ssize_t k = 0; k < size && !found; k++) {
        if (!kept(limit, members[k].logit, members[k].index))
            break;
        reached += by_mass ? members[k].weight : 1.0;
        mass += members[k].weight;
        if (reached >= goal) {
            int tied = k + 1 < size && members[k + 1].logit == members[k].logit;
            *cut = (Cut){members[k].logit, members[k].index, tied};
            *mass_to_cut = mass;
            found = 1;
        }
    }
    PyMem_RawFree(members);
    return found;
}

/* Where top_k and top_p end the kept part of the order (``*cut``), looking only at the ``heads`` tokens of
 * weight at least ``lightest``: 1 if the cuts fell among them, 0 if not, -1 if memory ran out. */
static int cut_among(const float *logits, const float *weights, Py_ssize_t n, float best, float inv_t, double total,
                     int top_k, double top_p, float lightest, Py_ssize_t heads, Cut *cut) {
    Py_ssize_t *counts = PyMem_RawCalloc(BINS, sizeof(Py_ssize_t));
    double *masses = PyMem_RawCalloc(BINS, sizeof(double));
    Candidate *candidates = PyMem_RawMalloc(sizeof(Candidate) * (size_t)heads);
    int status = -1;
    if (counts == NULL || masses == NULL || candidates == NULL)
        goto done;
    Py_ssize_t m = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (weights[i] > 0.0f && weights[i] >= lightest) {
            float depth = (best - logits[i]) * inv_t * BINS_PER_UNIT;
            int bin = depth < (float)(BINS - 1) ? (int)depth : BINS - 1;
            candidates[m++] = (Candidate){logits[i], weights[i], i, bin};
            counts[bin]++;
            masses[bin] += weights[i];
        }
    }
    double kept_mass = total, mass;
    int by_count = 0, by_mass = 0;
    if (top_k > 0) {
        by_count = find_cut(candidates, m, counts, masses, 0, (double)top_k, *cut, cut, &mass);
        if (by_count > 0)
            kept_mass = mass;
    }
    if (by_count >= 0 && top_p < 1.0)
        by_mass = find_cut(candidates, m, counts, masses, 1, top_p * kept_mass, *cut, cut, &mass);
    /* With top_k's cut among these tokens, top_p's is too (it is no later); without top_k, top_p's must be. */
    status = by_count < 0 || by_mass < 0 ? -1 : (top_k > 0 ? by_count : by_mass);
done:
    PyMem_RawFree(counts);
    PyMem_RawFree(masses);
    PyMem_RawFree(candidates);
    return status;
}

/* Where top_k and top_p end the kept part of the order (``*cut``); -1 if memory ran out. */
static int cut_order(const float *logits, const float *weights, Py_ssize_t n, float best, float inv_t, double total,
                     int top_k, double top_p, Cut *cut) {
    /* Most often the cuts fall among the few tokens near the heaviest: those are looked at first. */
    static const float depths[] = {8.0f, 16.0f};
    for (size_t d = 0; d < sizeof depths / sizeof *depths; d++) {
        Py_ssize_t heads;
        double head_mass;
        float lightest = expf(-depths[d]);
        head(weights, n, lightest, &heads, &head_mass);
        if (top_k > 0 ? heads >= top_k : head_mass >= top_p * total) {
            Cut first = *cut;
            int status = cut_among(logits, weights, n, best, inv_t, total, top_k, top_p, lightest, heads, &first);
            if (status != 0) {
                *cut = first;
                return status < 0 ? -1 : 0;
            }
        }
    }
    return cut_among(logits, weights, n, best, inv_t, total, top_k, top_p, 0.0f, n, cut) < 0 ? -1 : 0;
}

/* Zero the weights the filters drop and sum the blocks again; -1 if memory ran out. */
static int filter(const float *logits, float *weights, Py_ssize_t n, float best, float inv_t, double total, int top_k,
                  double top_p, double min_p, double *block_sums) {
    Cut cut = {-INFINITY, PY_SSIZE_T_MAX, 0};  /* keeps every token */
    if ((top_k > 0 || top_p < 1.0) && cut_order(logits, weights, n, best, inv_t, total, top_k, top_p, &cut) < 0)
        return -1;
    /* The heaviest token weighs 1: min_p keeps those of weight >= min_p. */
    drop(logits, weights, n, min_p > 0.0 ? (float)min_p : 0.0f, cut, block_sums);
    return 0;
}

/* Whether a buffer's format is one float32 in this machine's byte order ("f", "<f" from ctypes, ...). */
static int is_native_float(const char *format) {
    if (format == NULL)
        return 0;
    if (*format == '@' || *format == '=' || *format == (PY_LITTLE_ENDIAN ? '<' : '>'))
        format++;
    return strcmp(format, "f") == 0;
}

static PyObject *draw(PyObject *module, PyObject *args) {
    PyObject *source;
    float inv_t;
    int top_k;
    double top_p, min_p, u;
    if (!PyArg_ParseTuple(args, "Ofiddd:draw", &source, &inv_t, &top_k, &top_p, &min_p, &u))
        return NULL;
    if (!(inv_t > 0.0f && inv_t < INFINITY) || !(u >= 0.0 && u < 1.0) || !(min_p <= 1.0)) {
        PyErr_SetString(PyExc_ValueError, "draw needs a finite 1/temperature > 0, 0 <= u < 1 and min_p <= 1");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(source, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = view.len / (Py_ssize_t)sizeof(float);
    if (view.itemsize != sizeof(float) || !is_native_float(view.format) || n == 0) {
        PyErr_SetString(PyExc_TypeError, "draw needs a non-empty buffer of float32 logits");
        goto done;
    }
    float *weights = PyMem_RawMalloc(sizeof(float) * (size_t)n);
    double *block_sums = PyMem_RawMalloc(sizeof(double) * (size_t)((n + BLOCK - 1) / BLOCK));
    Py_ssize_t token = -1;
    int status = 0;
    if (weights == NULL || block_sums == NULL) {
        PyErr_NoMemory();
        goto freed;
    }
    const float *logits = view.buf;
    Py_BEGIN_ALLOW_THREADS
    float best = max_logit(logits, n);
    if (best > -INFINITY && best < INFINITY) {
        weigh(logits, n, best, inv_t, weights, block_sums);
        if (top_k > 0 || top_p < 1.0 || min_p > 0.0) {  /* filters */
            double total = 0.0;
            for (Py_ssize_t b = 0; b < (n + BLOCK - 1) / BLOCK; b++)
                total += block_sums[b];
            status = filter(logits, weights, n, best, inv_t, total, top_k, top_p, min_p, block_sums);
        }
        if (status == 0)
            token = walk(weights, n, block_sums, u);
    }
    Py_END_ALLOW_THREADS
    if (status < 0)
        PyErr_NoMemory();
    else if (token < 0)
        PyErr_SetString(PyExc_ValueError, "no token can be drawn: a logit is +inf, or every one is -inf or NaN");
    else
        result = PyLong_FromSsize_t(token);
freed:
    PyMem_RawFree(weights);
    PyMem_RawFree(block_sums);
done:
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"draw", draw, METH_VARARGS,
     "draw(logits, inv_temperature, top_k, top_p, min_p, u) -> token\n\n"
     "The token at u (0 <= u < 1) of the cumulative distribution of float32 logits at\n"
     "1/inv_temperature, after top_k (0: off), top_p (1: off) and min_p (0: off)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_draw", NULL, -1, methods};

PyMODINIT_FUNC PyInit__draw(void) { return PyModule_Create(&module); }
