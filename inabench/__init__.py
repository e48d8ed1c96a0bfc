"""Demo, benchmarks and training runs of the emulator (switchsim's `demo` and `bench` commands delegate
here), and the harness they share with the tests (inabench.harness). The switch itself is switchsim."""
