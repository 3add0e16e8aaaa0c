/* The CPU kernel's per-frame call as a Python function: host(address, elements, dtype code) ->
   (abs min, abs max) as floats, for a tensor below the parallel size, on the calling thread.
   Linked into the kernel's library beside cpu_kernel.c when Python's headers are found
   (core/measure/cpu_kernel_build.py); loaded as the extension module _tw_cpu_host. A call costs
   a third of the ctypes call it replaces (docs/performance.md); without the headers the
   ctypes call stays. */
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

static PyMethodDef tw_methods[] = {
    {"host", (PyCFunction)(void (*)(void))tw_host, METH_FASTCALL,
     "host(address, elements, dtype code) -> (abs min, abs max)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef tw_module = {PyModuleDef_HEAD_INIT, "_tw_cpu_host", NULL, -1, tw_methods,
                                       NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__tw_cpu_host(void) { return PyModule_Create(&tw_module); }
