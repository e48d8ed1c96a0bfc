// The inline path's reads of a dist.all_reduce call (torch_backend.ProcessGroupINA.allreduce), in one call
// into C++: is it made from the main thread outside backward (where the caller may run it: CallQueue), is its
// one tensor a contiguous strided CPU tensor, which reduce op and asyncOp did c10d's options ask for, and which
// lane holds that tensor's memory.
//
// In Python these are nine reads through torch's bindings and pybind (t.is_cpu, t.layout, t.is_contiguous(),
// opts.reduceOp.op, opts.asyncOp, t.data_ptr() ...). With the cold caches a rank has after each sleep they cost
// ~20 us of CPU of a 1 KiB call's ~100, most of it in pybind's dispatcher (docs/performance.md, "The torch rows'
// small calls"). So this is a plain CPython function, and it reads the options from their pybind instance
// directly: only when the object is exactly c10d's AllreduceOptions in pybind's simple layout (the value pointer
// first in the instance), as compiled here against the running torch's headers. For anything else it answers
// None, and the call takes the general path. tests/test_torch_backend.py holds it equal to the Python reads
// (torch_backend._python_reads), which apply where this extension cannot be built.
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/node.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/utils/pybind.h>

namespace py = pybind11;

static PyTypeObject* allreduce_options_type = nullptr;
static unsigned long main_thread = 0;  // threading.main_thread().ident

// For a call of one contiguous strided CPU tensor, SUM or AVG, from the main thread outside backward: its lane
// (lanes[(address, elements, dtype)], the key torch_calls.SwitchCalls.lanes keeps them under) where it has one
// and the call is a synchronous SUM, the commonest; otherwise ((address, elements, dtype), avg, asyncOp). None
// for any other call. The lane is looked up here, so the inline path's Python makes no tuple nor dict lookup of
// its own. Bound with pybind's m.def it cost the 4-rank loop as much as the Python reads (0.95 us warm against
// 0.18 as it is).
static PyObject* inline_call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "inline_call(tensors, opts, lanes)");
    return nullptr;
  }
  PyObject *ts = args[0], *o = args[1], *lanes = args[2];
  PyObject* t;
  if (PyList_CheckExact(ts) && PyList_GET_SIZE(ts) == 1)
    t = PyList_GET_ITEM(ts, 0);
  else if (PyTuple_CheckExact(ts) && PyTuple_GET_SIZE(ts) == 1)
    t = PyTuple_GET_ITEM(ts, 0);
  else
    Py_RETURN_NONE;
  if (PyThread_get_thread_ident() != main_thread || torch::autograd::get_current_node() != nullptr)
    Py_RETURN_NONE;  // another thread's or backward's call: queued, it progresses with nobody waiting on it
  if (allreduce_options_type == nullptr || Py_TYPE(o) != allreduce_options_type || !THPVariable_Check(t))
    Py_RETURN_NONE;
  auto* inst = reinterpret_cast<py::detail::instance*>(o);
  if (!inst->simple_layout || inst->simple_value_holder[0] == nullptr)
    Py_RETURN_NONE;
  const auto* options = static_cast<const c10d::AllreduceOptions*>(inst->simple_value_holder[0]);
  auto op = options->reduceOp.op_;
  if (op != c10d::ReduceOp::SUM && op != c10d::ReduceOp::AVG)
    Py_RETURN_NONE;
  const at::Tensor& x = THPVariable_Unpack(t);
  if (!x.is_cpu() || x.layout() != at::kStrided || !x.is_contiguous())
    Py_RETURN_NONE;
  PyObject* dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(x.scalar_type()));
  PyObject* address = PyLong_FromVoidPtr(x.data_ptr());
  PyObject* elements = PyLong_FromLongLong(x.numel());
  PyObject* key = address && elements ? PyTuple_Pack(3, address, elements, dtype) : nullptr;
  Py_XDECREF(address);
  Py_XDECREF(elements);
  if (key == nullptr)
    return nullptr;
  bool avg = op == c10d::ReduceOp::AVG;
  if (!avg && !options->asyncOp && PyDict_CheckExact(lanes)) {
    PyObject* lane = PyDict_GetItemWithError(lanes, key);  // borrowed
    if (lane != nullptr) {
      Py_DECREF(key);
      Py_INCREF(lane);
      return lane;
    }
    if (PyErr_Occurred()) {
      Py_DECREF(key);
      return nullptr;
    }
  }
  PyObject* got = PyTuple_Pack(3, key, avg ? Py_True : Py_False, options->asyncOp ? Py_True : Py_False);
  Py_DECREF(key);
  return got;
}

static PyMethodDef methods[] = {
    {"inline_call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(inline_call)), METH_FASTCALL,
     "inline_call(tensors, opts, lanes): the lane of a synchronous SUM the inline path takes (from the main "
     "thread, outside backward), else ((address, elements, dtype), avg, asyncOp) of one it may take, else None."},
    {nullptr, nullptr, 0, nullptr}};

void def_inline_call(py::module_& m) {
  py::object cls = py::module_::import("torch.distributed").attr("AllreduceOptions");
  allreduce_options_type = reinterpret_cast<PyTypeObject*>(cls.release().ptr());  // kept for the process's life
  main_thread = py::module_::import("threading").attr("main_thread")().attr("ident").cast<unsigned long>();
  if (PyModule_AddFunctions(m.ptr(), methods) != 0)
    throw py::error_already_set();
}
