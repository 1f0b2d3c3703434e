"""The calibration pipeline: decoder layer by decoder layer, a recipe's steps turn a model's linears
into `QuantizedWeight`s. `driver` is the loop; `staged` and `one_pass` the two strategies;
`chunked` the one-pass forward's memory-shaped pieces; `memory_policy` the platform's memory tricks;
`residency` a layer's tensors while it is worked on; `capture` the calibration inputs."""
from quantkit.pipeline.batching import calibration_batch_size, runs_in_one_pass  # noqa: F401
from quantkit.pipeline.capture import capture_layer_inputs  # noqa: F401
from quantkit.pipeline.driver import quantize_model  # noqa: F401
