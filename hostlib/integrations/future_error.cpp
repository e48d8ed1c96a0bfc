// Completes a torch Future with a Python exception as a C++ error that keeps the exception's class.
//
// torch.futures.Future.set_exception completes the future with the exception object as its *value* and a
// Python-only unwrap function: C++ readers of the future (DDP's reducer, c10d's comm hooks) take that value
// for the result tensors and crash. Here the future's error is a torch::python_error holding the exception:
// every reader that calls value() rethrows it, and torch's HANDLE_TH_ERRORS restores the same Python
// exception (class, message, traceback) wherever it reaches Python: wait(), loss.backward() under DDP.
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/jit/python/pybind_utils.h>

namespace py = pybind11;

static void set_error(const py::object& future, const py::object& exception) {
  auto wrapper = future.cast<std::shared_ptr<torch::jit::PythonFutureWrapper>>();
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exception.ptr())), exception.ptr());
  python_error error;
  error.persist();  // takes the exception out of the interpreter's error indicator; restore() increfs: rethrown any number of times
  auto eptr = std::make_exception_ptr(error);
  py::gil_scoped_release release;  // the future's callbacks (DDP's) run here, without the GIL
  wrapper->fut->setError(eptr);
}

void def_inline_call(py::module_& m);  // inline_call.cpp: the inline path's reads, built into this module

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("set_error", &set_error, "Complete `future` with `exception` as its C++ error (class kept).");
  def_inline_call(m);
}
