"""Core ML backend: a bundle as a stateful Core ML program (iOS 18 states for the KV cache), written with
coremltools from the bundle's own quantized weights. coremltools is imported only when a function runs."""
