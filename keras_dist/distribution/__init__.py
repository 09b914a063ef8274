"""What the user describes: device meshes, tensor layouts, layout maps and the
distribution policies (`DataParallel`, `ModelParallel`, `FSDP`), and the
global distribution they share with `keras.distribution`.

The public names are `keras_dist.DeviceMesh`, `keras_dist.DataParallel`, ...;
`keras_dist.distribution` is the function that returns the distribution in
effect.
"""
