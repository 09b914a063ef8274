"""What the backend adapters share: it imports nothing of keras_dist above it.

`step_rows` (the rows of the running step), `row_aware` (metrics, losses and
gradients over the real rows), `batch_norm` (BatchNormalization statistics over
the global batch), `padding`, `random_streams`, `job` (the job's shared facts)
and `validation` (argument checks).
"""
