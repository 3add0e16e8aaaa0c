/* The CPU kernel's per-frame call as a Python function: host(address, elements, dtype code) ->
   (abs min, abs max) as floats, for a tensor below the parallel size, on the calling thread.
   Linked into the kernel's library beside cpu_kernel.c when Python's headers are found
   (core/measure/cpu_kernel_build.py); loaded as the extension module _tw_cpu_host. A call costs
   a third of the ctypes call it replaces (docs/performance.md); without the headers the
   ctypes call stays.

   Beside it, same_entries(dicts, keys, ids): the model-integrity check of
   core/frames/param_index.py (ParamIndex.current) without a Python object made per entry. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

void tw_abs_minmax_many(const void* const* ptrs, const int64_t* ns, const int8_t* codes, int64_t k,
                        double* out, int nt, int64_t parallel_min);

static PyObject* tw_host(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "host(address, elements, dtype code) takes 3 arguments");
        return NULL;
    }
    const void* ptr = PyLong_AsVoidPtr(args[0]);
    int64_t n = (int64_t)PyLong_AsLongLong(args[1]);
    long code = PyLong_AsLong(args[2]);
    if (PyErr_Occurred())
        return NULL;
    if (n <= 0 || code < 0 || code > 3) {
        PyErr_SetString(PyExc_ValueError, "host(): elements must be positive and the dtype code 0-3");
        return NULL;
    }
    int8_t c = (int8_t)code;
    double out[2];
    tw_abs_minmax_many(&ptr, &n, &c, 1, out, 1, INT64_MAX);
    PyObject* lo = PyFloat_FromDouble(out[0]);
    PyObject* hi = PyFloat_FromDouble(out[1]);
    if (lo == NULL || hi == NULL) {
        Py_XDECREF(lo);
        Py_XDECREF(hi);
        return NULL;
    }
    PyObject* pair = PyTuple_New(2);
    if (pair == NULL) {
        Py_DECREF(lo);
        Py_DECREF(hi);
        return NULL;
    }
    PyTuple_SET_ITEM(pair, 0, lo);  /* (steals the references) */
    PyTuple_SET_ITEM(pair, 1, hi);
    return pair;
}

/* same_entries(dicts, keys, ids) -> bool: the plain dicts of the list `dicts`, walked in order,
   hold exactly the string keys of the list `keys`, in that order, and under them the objects
   whose addresses (id()) the uint64 buffer `ids` holds, one per key. False as soon as one
   differs, and where a key is not a plain string (the caller then compares in Python). Nothing
   is allocated and no Python code runs (a plain string's compare calls none), so no dict can
   change under the walk. */
static PyObject* tw_same_entries(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "same_entries(dicts, keys, ids) takes 3 arguments");
        return NULL;
    }
    PyObject* dicts = args[0];
    PyObject* keys = args[1];
    if (!PyList_CheckExact(dicts) || !PyList_CheckExact(keys)) {
        PyErr_SetString(PyExc_TypeError, "same_entries(): dicts and keys must be lists");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[2], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    Py_ssize_t nk = PyList_GET_SIZE(keys);
    int same = view.len == nk * (Py_ssize_t)sizeof(uint64_t);
    const uint64_t* ids = (const uint64_t*)view.buf;
    Py_ssize_t i = 0;
    Py_ssize_t nd = PyList_GET_SIZE(dicts);
    for (Py_ssize_t d = 0; same && d < nd; d++) {
        PyObject* dict = PyList_GET_ITEM(dicts, d);
        if (!PyDict_CheckExact(dict)) {
            same = 0;
            break;
        }
        Py_ssize_t pos = 0;
        PyObject *k, *v;
        while (PyDict_Next(dict, &pos, &k, &v)) {
            if (i >= nk) {
                same = 0;
                break;
            }
            PyObject* want = PyList_GET_ITEM(keys, i);
            if (k != want && (!PyUnicode_CheckExact(k) || !PyUnicode_CheckExact(want)
                              || PyUnicode_Compare(k, want) != 0)) {
                same = 0;
                break;
            }
            if ((uint64_t)(uintptr_t)v != ids[i]) {
                same = 0;
                break;
            }
            i++;
        }
    }
    PyBuffer_Release(&view);
    if (PyErr_Occurred())  /* (never expected: plain strings compare without error) */
        return NULL;
    return PyBool_FromLong(same && i == nk);
}

static PyMethodDef tw_methods[] = {
    {"host", (PyCFunction)(void (*)(void))tw_host, METH_FASTCALL,
     "host(address, elements, dtype code) -> (abs min, abs max)"},
    {"same_entries", (PyCFunction)(void (*)(void))tw_same_entries, METH_FASTCALL,
     "same_entries(dicts, keys, ids) -> the dicts hold these keys and objects, in order"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef tw_module = {PyModuleDef_HEAD_INIT, "_tw_cpu_host", NULL, -1, tw_methods,
                                       NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__tw_cpu_host(void) { return PyModule_Create(&tw_module); }
