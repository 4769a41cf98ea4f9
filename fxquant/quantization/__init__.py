"""Weight quantization below the passes: a weight quantized once, why a weight stays in high precision, the store of
quantized and lane-packed copies every graph of a model shares, and which ops compute a quantized linear."""
