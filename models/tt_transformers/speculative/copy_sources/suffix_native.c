// SPDX-License-Identifier: Apache-2.0
// The per-iteration work of model-free drafting, as a CPython extension: the suffix automaton (suffix_automaton.py),
// the table of recycled target predictions and the token-tree builder (token_tree.py). Each is a line-for-line
// port of the Python reference next to it, same arithmetic in the same order (IEEE doubles, no fast-math), so the
// drafts are identical; tests/speculative/test_suffix_native.py checks that on generated inputs. Python objects cross the
// boundary only as ints, floats and lists, read and built in place (no ctypes marshalling).
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CHAIN_CAP 64
#define MAX_BUCKETS 32

static int n_length_buckets = 0;
static int longest_bucket = 0;                   // the last bucket's lower bound: longer contexts share it
static int bucket_of_length[4096];               // context length (<= longest_bucket) -> bucket

static int bucket_of(int64_t length) { return bucket_of_length[length < longest_bucket ? length : longest_bucket]; }

// ---------------------------------------------------------------------------------------------------------------
// An open-addressing map from a 64-bit key to a 32-bit value (never deletes).
typedef struct {
    uint64_t *keys;
    int32_t *values;  // -1: empty
    int64_t cap, used;
} Map;

static uint64_t map_hash(uint64_t key) { return key * 0x9E3779B97F4A7C15ull; }

static int64_t map_slot(const Map *m, uint64_t key) {
    int64_t mask = m->cap - 1, i = (int64_t)(map_hash(key) >> 20) & mask;
    while (m->values[i] >= 0 && m->keys[i] != key) i = (i + 1) & mask;
    return i;
}

static int32_t map_get(const Map *m, uint64_t key) { return m->cap ? m->values[map_slot(m, key)] : -1; }

static int map_put(Map *m, uint64_t key, int32_t value) {
    if (2 * (m->used + 1) > m->cap) {
        Map bigger = {NULL, NULL, m->cap ? 2 * m->cap : 64, 0};
        bigger.keys = malloc(bigger.cap * sizeof(uint64_t));
        bigger.values = malloc(bigger.cap * sizeof(int32_t));
        if (!bigger.keys || !bigger.values) {
            free(bigger.keys);
            free(bigger.values);
            PyErr_NoMemory();
            return -1;
        }
        memset(bigger.values, 0xff, bigger.cap * sizeof(int32_t));
        for (int64_t i = 0; i < m->cap; i++)
            if (m->values[i] >= 0) {
                int64_t s = map_slot(&bigger, m->keys[i]);
                bigger.keys[s] = m->keys[i];
                bigger.values[s] = m->values[i];
            }
        bigger.used = m->used;
        free(m->keys);
        free(m->values);
        *m = bigger;
    }
    int64_t s = map_slot(m, key);
    if (m->values[s] < 0) m->used++;
    m->keys[s] = key;
    m->values[s] = value;
    return 0;
}

static void map_free(Map *m) {
    free(m->keys);
    free(m->values);
}

static int grow(void **array, int64_t *cap, int64_t need, size_t item) {
    if (need <= *cap) return 0;
    int64_t cap2 = *cap ? *cap : 64;
    while (cap2 < need) cap2 *= 2;
    void *p = realloc(*array, cap2 * item);
    if (!p) {
        PyErr_NoMemory();
        return -1;
    }
    *array = p;
    *cap = cap2;
    return 0;
}

static uint64_t edge_key(int32_t state, int64_t token) {
    return ((uint64_t)(uint32_t)state << 32) | (uint32_t)(int32_t)token;
}

// Appends a new reference (NULL: its creation failed) and drops it: -1 on any failure.
static int append_new(PyObject *list, PyObject *item) {
    int bad = !item || PyList_Append(list, item);
    Py_XDECREF(item);
    return bad ? -1 : 0;
}

static Py_ssize_t shorter(PyObject *fast_a, PyObject *fast_b) {
    Py_ssize_t a = PySequence_Fast_GET_SIZE(fast_a), b = PySequence_Fast_GET_SIZE(fast_b);
    return a < b ? a : b;
}

// ---------------------------------------------------------------------------------------------------------------
// The suffix automaton (see suffix_automaton.py for what each field means).
typedef struct {
    int32_t link, length, recent, count, cont, best, first_edge;
} State;

typedef struct {
    int32_t token, to, next;  // next: the state's next edge (-1: none)
} Edge;

typedef struct {
    PyObject_HEAD
    PyObject *tokens;  // list of ints: the text
    State *states;
    int64_t n_states, states_cap;
    Edge *edges;
    int64_t n_edges, edges_cap;
    Map transitions;  // (state, token) -> edge
    int32_t last, match_state, match_len, match_end;
    int initialised;  // __init__ ran (it extends with the given tokens once)
} Automaton;

static int32_t transition(const Automaton *a, int32_t state, int64_t token) {
    int32_t e = map_get(&a->transitions, edge_key(state, token));
    return e < 0 ? -1 : a->edges[e].to;
}

static int32_t new_state(Automaton *a, State s) {
    if (grow((void **)&a->states, &a->states_cap, a->n_states + 1, sizeof(State))) return -1;
    s.first_edge = -1;
    a->states[a->n_states] = s;
    return (int32_t)a->n_states++;
}

static int add_edge(Automaton *a, int32_t from, int32_t token, int32_t to) {
    if (grow((void **)&a->edges, &a->edges_cap, a->n_edges + 1, sizeof(Edge))) return -1;
    int32_t e = (int32_t)a->n_edges;
    if (map_put(&a->transitions, edge_key(from, token), e)) return -1;
    a->edges[e] = (Edge){token, to, a->states[from].first_edge};
    a->states[from].first_edge = e;
    a->n_edges++;
    return 0;
}

static int automaton_extend(Automaton *a, int64_t token64) {
    int32_t token = (int32_t)token64;
    int32_t pos = (int32_t)PyList_GET_SIZE(a->tokens);
    if (append_new(a->tokens, PyLong_FromLongLong(token64))) return -1;
    int32_t previous = a->last;
    int32_t cur = new_state(a, (State){0, a->states[previous].length + 1, pos, 0, 0, -1, -1});
    if (cur < 0) return -1;
    int32_t p = previous;
    while (p != -1 && transition(a, p, token) < 0) {
        if (add_edge(a, p, token, cur)) return -1;
        p = a->states[p].link;
    }
    if (p != -1) {
        int32_t q = transition(a, p, token);
        if (a->states[p].length + 1 == a->states[q].length) {
            a->states[cur].link = q;
        } else {  // split q: the clone keeps the strings up to length[p] + 1, and q's occurrences so far
            State sq = a->states[q];
            int32_t clone =
                new_state(a, (State){sq.link, a->states[p].length + 1, sq.recent, sq.count, sq.cont, sq.best, -1});
            if (clone < 0) return -1;
            for (int32_t e = a->states[q].first_edge; e >= 0; e = a->edges[e].next)
                if (add_edge(a, clone, a->edges[e].token, a->edges[e].to)) return -1;
            while (p != -1) {
                int32_t e = map_get(&a->transitions, edge_key(p, token));
                if (e < 0 || a->edges[e].to != q) break;
                a->edges[e].to = clone;
                p = a->states[p].link;
            }
            a->states[q].link = a->states[cur].link = clone;
        }
    }
    a->last = cur;
    State *s = a->states;
    for (int32_t x = cur, steps = 0; x > 0 && steps < CHAIN_CAP; x = s[x].link, steps++) s[x].count++;
    for (int32_t x = previous, steps = 0; x > 0 && steps < CHAIN_CAP; x = s[x].link, steps++) {
        s[x].cont++;
        int32_t b = s[x].best, to_token, to_best;
        if (b < 0 || b == token ||
            ((to_token = transition(a, x, token)) >= 0 && (to_best = transition(a, x, b)) >= 0 &&
             s[to_token].count >= s[to_best].count))
            s[x].best = token;
    }
    int32_t match = s[cur].link;
    a->match_state = match;
    a->match_len = s[match].length;
    a->match_end = s[match].recent;
    s[match].recent = pos;
    return 0;
}

static void automaton_dealloc(Automaton *a) {
    Py_XDECREF(a->tokens);
    free(a->states);
    free(a->edges);
    map_free(&a->transitions);
    Py_TYPE(a)->tp_free((PyObject *)a);
}

static PyObject *automaton_extend_py(Automaton *a, PyObject *token) {
    long long t = PyLong_AsLongLong(token);
    if (t == -1 && PyErr_Occurred()) return NULL;
    if (t < INT32_MIN || t > INT32_MAX)
        return PyErr_Format(PyExc_OverflowError, "token id %lld does not fit 32 bits", t);
    if (automaton_extend(a, t)) return NULL;
    Py_RETURN_NONE;
}

// The empty automaton (the root state) exists from allocation on, so no method meets a half-made object.
static PyObject *automaton_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    Automaton *a = (Automaton *)PyType_GenericNew(type, args, kwds);
    if (!a) return NULL;
    a->tokens = PyList_New(0);
    if (!a->tokens || new_state(a, (State){-1, 0, -1, 0, 0, -1, -1}) < 0) {
        Py_DECREF(a);
        return NULL;
    }
    a->last = a->match_state = a->match_len = 0;
    a->match_end = -1;
    return (PyObject *)a;
}

static int automaton_init(Automaton *a, PyObject *args, PyObject *kwds) {
    PyObject *tokens = NULL;
    static char *kwlist[] = {"tokens", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O", kwlist, &tokens)) return -1;
    if (a->initialised) {
        PyErr_SetString(PyExc_RuntimeError, "SuffixAutomaton is initialised once");
        return -1;
    }
    a->initialised = 1;
    if (tokens) {
        PyObject *seq = PySequence_Fast(tokens, "tokens must be a sequence of ints");
        if (!seq) return -1;
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++)
            if (!automaton_extend_py(a, PySequence_Fast_GET_ITEM(seq, i))) {
                Py_DECREF(seq);
                return -1;
            }
        Py_DECREF(seq);
    }
    return 0;
}

static int check_state(const Automaton *a, long long state) {
    if (state < 0 || state >= a->n_states) {
        PyErr_Format(PyExc_IndexError, "state %lld out of range (%lld states)", state, (long long)a->n_states);
        return -1;
    }
    return 0;
}

static int read_rates(PyObject *rates, double *out) {
    PyObject *seq = PySequence_Fast(rates, "rates must be a sequence of floats");
    if (!seq) return -1;
    if (PySequence_Fast_GET_SIZE(seq) != n_length_buckets) {
        PyErr_Format(PyExc_ValueError, "rates: %d values expected (one per length bucket)", n_length_buckets);
        Py_DECREF(seq);
        return -1;
    }
    for (int i = 0; i < n_length_buckets; i++) {
        out[i] = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(seq, i));
        if (out[i] == -1.0 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return -1;
        }
    }
    Py_DECREF(seq);
    return 0;
}

static PyObject *automaton_continuation(Automaton *a, PyObject *args) {
    long long state, context_len, max_tokens;
    PyObject *rates_obj;
    double floor_, rates[MAX_BUCKETS];
    if (!PyArg_ParseTuple(args, "LLLOd", &state, &context_len, &max_tokens, &rates_obj, &floor_)) return NULL;
    if (check_state(a, state) || read_rates(rates_obj, rates)) return NULL;
    PyObject *tokens = PyList_New(0), *freqs = PyList_New(0), *probs = PyList_New(0);
    if (!tokens || !freqs || !probs) goto fail;
    const State *s = a->states;
    double p = 1.0;
    while (PyList_GET_SIZE(tokens) < max_tokens) {
        while (s[state].cont == 0 && state > 0) {
            state = s[state].link;
            context_len = s[state].length;
        }
        if (s[state].cont == 0) break;
        int32_t token = s[state].best;
        if (token < 0) break;
        int32_t child = transition(a, (int32_t)state, token);
        double f = (double)s[child].count / s[state].cont;
        double q = rates[bucket_of(context_len)] * f;
        p *= q < 0.99 ? q : 0.99;
        if (p < floor_) break;
        if (append_new(tokens, PyLong_FromLong(token)) || append_new(freqs, PyFloat_FromDouble(f)) ||
            append_new(probs, PyFloat_FromDouble(p)))
            goto fail;
        state = child;
        context_len++;
    }
    return Py_BuildValue("(NNN)", tokens, freqs, probs);
fail:
    Py_XDECREF(tokens);
    Py_XDECREF(freqs);
    Py_XDECREF(probs);
    return NULL;
}

static PyObject *automaton_anchors(Automaton *a, PyObject *args) {
    long long state, min_len, limit;
    if (!PyArg_ParseTuple(args, "LLL", &state, &min_len, &limit)) return NULL;
    if (check_state(a, state)) return NULL;
    PyObject *out = PyList_New(0);
    while (out && state > 0 && a->states[state].length >= min_len && PyList_GET_SIZE(out) < limit) {
        if (append_new(out, Py_BuildValue("(Li)", state, a->states[state].length))) {
            Py_DECREF(out);
            return NULL;
        }
        state = a->states[state].link;
    }
    return out;
}

static PyObject *automaton_advance(Automaton *a, PyObject *args) {
    long long state, length, token;
    if (!PyArg_ParseTuple(args, "LLL", &state, &length, &token)) return NULL;
    if (check_state(a, state)) return NULL;
    if (token < INT32_MIN || token > INT32_MAX) return Py_BuildValue("(ii)", 0, 0);
    while (state > 0 && transition(a, (int32_t)state, token) < 0) {
        state = a->states[state].link;
        length = a->states[state].length;
    }
    int32_t to = transition(a, (int32_t)state, token);
    return to >= 0 ? Py_BuildValue("(iL)", to, length + 1) : Py_BuildValue("(ii)", 0, 0);
}

static PyObject *automaton_state(Automaton *a, PyObject *arg) {
    long long state = PyLong_AsLongLong(arg);
    if ((state == -1 && PyErr_Occurred()) || check_state(a, state)) return NULL;
    const State *s = &a->states[state];
    return Py_BuildValue("(iiiiii)", s->length, s->link, s->recent, s->count, s->cont, s->best);
}

static PyObject *automaton_transition(Automaton *a, PyObject *args) {
    long long state, token;
    if (!PyArg_ParseTuple(args, "LL", &state, &token)) return NULL;
    if (check_state(a, state)) return NULL;
    return PyLong_FromLong(token < INT32_MIN || token > INT32_MAX ? -1 : transition(a, (int32_t)state, token));
}

static PyObject *automaton_nbytes(Automaton *a, void *unused) {
    return PyLong_FromLongLong(a->states_cap * sizeof(State) + a->edges_cap * sizeof(Edge) +
                               a->transitions.cap * (sizeof(uint64_t) + sizeof(int32_t)));
}

static PyMethodDef automaton_methods[] = {
    {"extend", (PyCFunction)automaton_extend_py, METH_O, "Append one token."},
    {"continuation", (PyCFunction)automaton_continuation, METH_VARARGS,
     "(state, context_len, max_tokens, rates, floor)"},
    {"anchors", (PyCFunction)automaton_anchors, METH_VARARGS, "(state, min_len, limit) -> [(state, length)]"},
    {"advance", (PyCFunction)automaton_advance, METH_VARARGS, "(state, length, token) -> (state, length)"},
    {"state", (PyCFunction)automaton_state, METH_O, "state -> (length, link, recent, count, cont, best)"},
    {"transition", (PyCFunction)automaton_transition, METH_VARARGS, "(state, token) -> state, -1 when none"},
    {NULL}};

static PyMemberDef automaton_members[] = {
    {"match_state", T_INT, offsetof(Automaton, match_state), READONLY, NULL},
    {"match_len", T_INT, offsetof(Automaton, match_len), READONLY, NULL},
    {"match_end", T_INT, offsetof(Automaton, match_end), READONLY, NULL},
    {"n_states", T_LONGLONG, offsetof(Automaton, n_states), READONLY, NULL},
    {"n_transitions", T_LONGLONG, offsetof(Automaton, n_edges), READONLY, NULL},
    {"tokens", T_OBJECT_EX, offsetof(Automaton, tokens), READONLY, NULL},
    {NULL}};

static PyGetSetDef automaton_getset[] = {{"nbytes", (getter)automaton_nbytes, NULL, "memory held", NULL}, {NULL}};

static PyTypeObject AutomatonType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "suffix_native.SuffixAutomaton",
    .tp_basicsize = sizeof(Automaton),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Online suffix automaton with occurrence counts (suffix_automaton.py is the reference).",
    .tp_new = automaton_new,
    .tp_init = (initproc)automaton_init,
    .tp_dealloc = (destructor)automaton_dealloc,
    .tp_methods = automaton_methods,
    .tp_members = automaton_members,
    .tp_getset = automaton_getset,
};

// ---------------------------------------------------------------------------------------------------------------
// Recycled target predictions: token -> the target's top-k next tokens the last time it computed them after it.
typedef struct {
    PyObject_HEAD
    int32_t k;
    int32_t *ids;  // k per entry; a shorter list is padded with -1
    int64_t n, cap;
    Map index;  // token -> entry
} Recycled;

static int recycled_init(Recycled *r, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"k", NULL};
    int k;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "i", kwlist, &k)) return -1;
    if (r->k) {  // the rows are sized by k
        PyErr_SetString(PyExc_RuntimeError, "RecycledTokens is initialised once");
        return -1;
    }
    if (k < 1) {
        PyErr_SetString(PyExc_ValueError, "k must be >= 1");
        return -1;
    }
    r->k = k;
    return 0;
}

static void recycled_dealloc(Recycled *r) {
    free(r->ids);
    map_free(&r->index);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static const int32_t *recycled_row(const Recycled *r, int64_t token) {
    int32_t e = map_get(&r->index, (uint64_t)token);
    return e < 0 ? NULL : r->ids + (int64_t)e * r->k;
}

static PyObject *recycled_observe(Recycled *r, PyObject *args) {
    PyObject *fed, *top;
    if (!PyArg_ParseTuple(args, "OO", &fed, &top)) return NULL;
    PyObject *f = PySequence_Fast(fed, "fed must be a sequence");
    PyObject *t = f ? PySequence_Fast(top, "top_ids must be a sequence") : NULL;
    if (!t) goto fail;
    Py_ssize_t n = shorter(f, t);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *ids = PySequence_Fast(PySequence_Fast_GET_ITEM(t, i), "top_ids rows must be sequences");
        if (!ids) goto fail;
        Py_ssize_t m = PySequence_Fast_GET_SIZE(ids);
        if (m > r->k) {
            Py_DECREF(ids);
            PyErr_Format(PyExc_ValueError, "%zd top ids for a table of k=%d", m, r->k);
            goto fail;
        }
        long long token = m ? PyLong_AsLongLong(PySequence_Fast_GET_ITEM(f, i)) : 0;
        if (m && token == -1 && PyErr_Occurred()) {
            Py_DECREF(ids);
            goto fail;
        }
        if (m) {
            int32_t e = map_get(&r->index, (uint64_t)token);
            if (e < 0) {
                if (grow((void **)&r->ids, &r->cap, (r->n + 1) * r->k, sizeof(int32_t)) ||
                    map_put(&r->index, (uint64_t)token, (int32_t)r->n)) {
                    Py_DECREF(ids);
                    goto fail;
                }
                e = (int32_t)r->n++;
            }
            int32_t *row = r->ids + (int64_t)e * r->k;
            for (int j = 0; j < r->k; j++) {
                long long id = j < m ? PyLong_AsLongLong(PySequence_Fast_GET_ITEM(ids, j)) : -1;
                if (id == -1 && PyErr_Occurred()) {
                    Py_DECREF(ids);
                    goto fail;
                }
                row[j] = (int32_t)id;
            }
        }
        Py_DECREF(ids);
    }
    Py_DECREF(f);
    Py_DECREF(t);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(f);
    Py_XDECREF(t);
    return NULL;
}

static PyObject *recycled_get(Recycled *r, PyObject *arg) {
    long long token = PyLong_AsLongLong(arg);
    if (token == -1 && PyErr_Occurred()) return NULL;
    const int32_t *row = recycled_row(r, token);
    if (!row) Py_RETURN_NONE;
    PyObject *out = PyList_New(0);
    for (int j = 0; out && j < r->k && row[j] >= 0; j++)
        if (append_new(out, PyLong_FromLong(row[j]))) Py_CLEAR(out);
    return out;
}

static PyObject *recycled_chain(Recycled *r, PyObject *args) {
    long long token, n;
    double p_step, floor_;
    if (!PyArg_ParseTuple(args, "LLdd", &token, &n, &p_step, &floor_)) return NULL;
    PyObject *tokens = PyList_New(0), *probs = PyList_New(0);
    double p = 1.0;
    const int32_t *row;
    int bad = !tokens || !probs;
    while (!bad && PyList_GET_SIZE(tokens) < n && (row = recycled_row(r, token)) && p * p_step >= floor_) {
        token = row[0];
        p = p * p_step;
        bad = append_new(tokens, PyLong_FromLongLong(token)) || append_new(probs, PyFloat_FromDouble(p));
    }
    if (bad) {
        Py_XDECREF(tokens);
        Py_XDECREF(probs);
        return NULL;
    }
    return Py_BuildValue("(NN)", tokens, probs);
}

static Py_ssize_t recycled_len(Recycled *r) { return (Py_ssize_t)r->n; }

static PyMethodDef recycled_methods[] = {
    {"observe", (PyCFunction)recycled_observe, METH_VARARGS, "(fed, top_ids): remember each row's top ids"},
    {"get", (PyCFunction)recycled_get, METH_O, "token -> its top ids, or None"},
    {"chain", (PyCFunction)recycled_chain, METH_VARARGS, "(last, n, p_step, floor) -> (tokens, probs)"},
    {NULL}};

static PyMemberDef recycled_members[] = {
    {"k", T_INT, offsetof(Recycled, k), READONLY, "top ids kept per token"}, {NULL}};

static PySequenceMethods recycled_as_sequence = {.sq_length = (lenfunc)recycled_len};

static PyTypeObject RecycledType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "suffix_native.RecycledTokens",
    .tp_basicsize = sizeof(Recycled),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Token Recycling's adjacency table (token_tree.py is the reference).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)recycled_init,
    .tp_dealloc = (destructor)recycled_dealloc,
    .tp_methods = recycled_methods,
    .tp_members = recycled_members,
    .tp_as_sequence = &recycled_as_sequence,
};

// ---------------------------------------------------------------------------------------------------------------
// The token tree (token_tree.build_tree is the reference and says why each step is what it is).
typedef struct {
    int32_t token, parent, origin, offset;
    double prob, taken;  // taken: the sum of its children's probabilities
} Node;

typedef struct {
    double q;
    int64_t order;
    int32_t parent, token, rank;
} Pending;

typedef struct {
    Node *nodes;
    int64_t n, cap;
    double root_taken;
    Map index;  // (parent + 1, token) -> node
    Pending *heap;
    int64_t heap_n, heap_cap, order;
} Tree;

static double *taken_of(Tree *t, int32_t parent) { return parent >= 0 ? &t->nodes[parent].taken : &t->root_taken; }

static double room(Tree *t, int32_t parent) {
    return (parent >= 0 ? t->nodes[parent].prob : 1.0) - *taken_of(t, parent);
}

static int32_t tree_find(Tree *t, int32_t parent, int64_t token) {
    return map_get(&t->index, edge_key(parent + 1, token));
}

static int32_t tree_add(Tree *t, int32_t parent, int32_t token, double p, int32_t origin, int32_t offset) {
    if (grow((void **)&t->nodes, &t->cap, t->n + 1, sizeof(Node)) ||
        map_put(&t->index, edge_key(parent + 1, token), (int32_t)t->n))
        return -1;
    t->nodes[t->n] = (Node){token, parent, origin, offset, p, 0.0};
    *taken_of(t, parent) += p;
    return (int32_t)t->n++;
}

static int before(const Pending *a, const Pending *b) { return a->q > b->q || (a->q == b->q && a->order < b->order); }

static int heap_push(Tree *t, double q, int32_t parent, int32_t token, int32_t rank) {
    if (grow((void **)&t->heap, &t->heap_cap, t->heap_n + 1, sizeof(Pending))) return -1;
    int64_t i = t->heap_n++;
    Pending item = {q, t->order++, parent, token, rank};
    while (i > 0 && before(&item, &t->heap[(i - 1) / 2])) {
        t->heap[i] = t->heap[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    t->heap[i] = item;
    return 0;
}

static Pending heap_pop(Tree *t) {
    Pending top = t->heap[0], item = t->heap[--t->heap_n];
    int64_t i = 0;
    for (;;) {
        int64_t c = 2 * i + 1;
        if (c >= t->heap_n) break;
        if (c + 1 < t->heap_n && before(&t->heap[c + 1], &t->heap[c])) c++;
        if (!before(&t->heap[c], &item)) break;
        t->heap[i] = t->heap[c];
        i = c;
    }
    if (t->heap_n) t->heap[i] = item;
    return top;
}

static int push_children(Tree *t, const Recycled *table, const double *rank_probs, int32_t parent, int64_t token,
                         double p, double floor_) {
    const int32_t *row = recycled_row(table, token);
    for (int rank = 0; row && rank < table->k && row[rank] >= 0; rank++) {
        double q = p * rank_probs[rank];
        if (q >= floor_ && tree_find(t, parent, row[rank]) < 0 && heap_push(t, q, parent, row[rank], rank))
            return -1;
    }
    return 0;
}

static int double_at(PyObject *seq, Py_ssize_t i, double *out) {
    *out = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(seq, i));
    return *out == -1.0 && PyErr_Occurred() ? -1 : 0;
}

static int grow_tree(Tree *t, long long last, PyObject *candidates, PyObject *table_obj, PyObject *recycle_rates,
                     long long n, double floor_) {
    PyObject *cands = PySequence_Fast(candidates, "candidates must be a sequence of (tokens, probs)");
    if (!cands) return -1;
    for (Py_ssize_t c = 0; c < PySequence_Fast_GET_SIZE(cands); c++) {
        PyObject *pair = PySequence_Fast_GET_ITEM(cands, c), *toks, *probs;
        if (!PyArg_ParseTuple(pair, "OO", &toks, &probs)) goto fail;
        PyObject *tk = PySequence_Fast(toks, "candidate tokens");
        PyObject *pr = tk ? PySequence_Fast(probs, "candidate probs") : NULL;
        if (!pr) {
            Py_XDECREF(tk);
            goto fail;
        }
        Py_ssize_t m = shorter(tk, pr);
        int32_t parent = -1;
        double prior = 1.0;
        int bad = 0;
        for (Py_ssize_t j = 0; j < m; j++) {
            long long token = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(tk, j));
            double p;
            if ((token == -1 && PyErr_Occurred()) || double_at(pr, j, &p)) {
                bad = 1;
                break;
            }
            double parent_prob = parent >= 0 ? t->nodes[parent].prob : 1.0;
            double scaled = parent_prob * p / prior;
            prior = p;
            p = scaled;
            int32_t at = tree_find(t, parent, token);
            if (at < 0) {
                double r = room(t, parent);
                p = p < r ? p : r;
                if (p < floor_) break;
                at = tree_add(t, parent, (int32_t)token, p, (int32_t)c, (int32_t)j);
                if (at < 0) {
                    bad = 1;
                    break;
                }
            } else if (p > t->nodes[at].prob) {
                double r = room(t, parent) + t->nodes[at].prob;
                p = p < r ? p : r;
                *taken_of(t, parent) += p - t->nodes[at].prob;
                t->nodes[at].prob = p;
            }
            parent = at;
        }
        Py_DECREF(tk);
        Py_DECREF(pr);
        if (bad) goto fail;
    }
    Py_DECREF(cands);
    if (table_obj != Py_None) {
        if (!PyObject_TypeCheck(table_obj, &RecycledType)) {
            PyErr_SetString(PyExc_TypeError, "table must be a suffix_native.RecycledTokens or None");
            return -1;
        }
        const Recycled *table = (const Recycled *)table_obj;
        double rates[MAX_BUCKETS], rank_probs[64];
        if (table->k > 64) {
            PyErr_SetString(PyExc_ValueError, "recycled tables keep at most 64 ids per token");
            return -1;
        }
        if (read_rates(recycle_rates, rates)) return -1;
        for (int r = 0; r < table->k; r++) {  // MatchAcceptance.prob(rank, 1.0)
            double q = rates[bucket_of(r + 1)] * 1.0;
            rank_probs[r] = q < 0.99 ? q : 0.99;
        }
        if (push_children(t, table, rank_probs, -1, last, 1.0, floor_)) return -1;
        int64_t copied = t->n;
        for (int32_t i = 0; i < copied; i++)
            if (push_children(t, table, rank_probs, i, t->nodes[i].token, t->nodes[i].prob, floor_)) return -1;
        int64_t limit = t->n + n;  // recycled nodes compete with the copied ones for the n places
        while (t->heap_n && t->n < limit) {
            Pending item = heap_pop(t);
            if (tree_find(t, item.parent, item.token) >= 0) continue;
            if (item.q > room(t, item.parent)) {  // siblings took part of the parent's probability since
                double r = room(t, item.parent);
                if (r >= floor_ && heap_push(t, r, item.parent, item.token, item.rank)) return -1;
                continue;
            }
            int32_t at = tree_add(t, item.parent, item.token, item.q, -1, item.rank);
            if (at < 0 || push_children(t, table, rank_probs, at, item.token, item.q, floor_)) return -1;
        }
    }
    return 0;
fail:
    Py_DECREF(cands);
    return -1;
}

static PyObject *build_tree(PyObject *self, PyObject *args) {
    long long last, n;
    PyObject *candidates, *table, *recycle_rates;
    double floor_;
    if (!PyArg_ParseTuple(args, "LOOOLd", &last, &candidates, &table, &recycle_rates, &n, &floor_)) return NULL;
    Tree t = {0};
    PyObject *out = NULL;
    if (grow_tree(&t, last, candidates, table, recycle_rates, n, floor_) == 0) {
        // the n most probable nodes, ties in order of creation (a child is never more probable than its parent)
        int64_t m = t.n;
        int32_t *order = malloc((m ? m : 1) * sizeof(int32_t)), *where = malloc((m ? m : 1) * sizeof(int32_t));
        if (!order || !where) {
            PyErr_NoMemory();
        } else {
            for (int32_t i = 0; i < m; i++) {  // stable insertion sort by probability, descending
                int32_t j = i;
                while (j > 0 && t.nodes[order[j - 1]].prob < t.nodes[i].prob) {
                    order[j] = order[j - 1];
                    j--;
                }
                order[j] = i;
            }
            int64_t kept = m < n ? m : (n > 0 ? n : 0);
            for (int32_t i = 0; i < m; i++) where[i] = -1;
            for (int32_t i = 0; i < kept; i++) where[order[i]] = i;
            PyObject *lists[5];
            for (int l = 0; l < 5; l++) lists[l] = PyList_New(kept);
            int ok = lists[0] && lists[1] && lists[2] && lists[3] && lists[4];
            for (int64_t i = 0; ok && i < kept; i++) {
                const Node *node = &t.nodes[order[i]];
                PyObject *v[5] = {PyLong_FromLong(node->token),
                                  PyLong_FromLong(node->parent >= 0 ? where[node->parent] : -1),
                                  PyFloat_FromDouble(node->prob), PyLong_FromLong(node->origin),
                                  PyLong_FromLong(node->offset)};
                for (int l = 0; l < 5; l++) {
                    if (!v[l]) ok = 0;
                    else PyList_SET_ITEM(lists[l], i, v[l]);
                }
            }
            if (ok) out = Py_BuildValue("(NNNNN)", lists[0], lists[1], lists[2], lists[3], lists[4]);
            else
                for (int l = 0; l < 5; l++) Py_XDECREF(lists[l]);
        }
        free(order);
        free(where);
    }
    free(t.nodes);
    free(t.heap);
    map_free(&t.index);
    return out;
}

static PyObject *set_length_buckets(PyObject *self, PyObject *arg) {
    PyObject *seq = PySequence_Fast(arg, "length buckets must be a sequence of ints");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    long bounds[MAX_BUCKETS];
    int bad = n < 1 || n > MAX_BUCKETS;
    for (Py_ssize_t i = 0; !bad && i < n; i++) {
        bounds[i] = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
        bad = (bounds[i] == -1 && PyErr_Occurred()) || bounds[i] < 0 || bounds[i] >= 4096 ||
              (i && bounds[i] <= bounds[i - 1]);
    }
    Py_DECREF(seq);
    if (bad) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "length buckets: 1-32 increasing lengths below 4096");
        return NULL;
    }
    n_length_buckets = (int)n;
    longest_bucket = (int)bounds[n - 1];
    for (int len = 0; len <= longest_bucket; len++) {  // bisect_right(bounds, len) - 1, at least 0
        int b = 0;
        while (b + 1 < n && bounds[b + 1] <= len) b++;
        bucket_of_length[len] = b;
    }
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"build_tree", build_tree, METH_VARARGS,
     "(last, candidates, table, recycle_rates, n, floor) -> (tokens, parents, probs, origins, offsets)"},
    {"set_length_buckets", set_length_buckets, METH_O, "the lower bounds of draft_length.LENGTH_BUCKETS"},
    {NULL}};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "suffix_native", NULL, -1, module_methods};

PyMODINIT_FUNC PyInit_suffix_native(void) {
    if (PyType_Ready(&AutomatonType) < 0 || PyType_Ready(&RecycledType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (!m) return NULL;
    Py_INCREF(&AutomatonType);
    Py_INCREF(&RecycledType);
    if (PyModule_AddObject(m, "SuffixAutomaton", (PyObject *)&AutomatonType) < 0 ||
        PyModule_AddObject(m, "RecycledTokens", (PyObject *)&RecycledType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
