// Python module init for attention_ext._C. Importing it loads the shared library, whose static
// TORCH_LIBRARY blocks register the ops; the module itself defines no functions.
#include <Python.h>

extern "C" {
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}
