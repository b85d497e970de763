"""What users do with a converted module: reports, ONNX export and validation, profiling,
loading weights."""
