"""The TensorFlow backend: `tf.distribute` strategies."""
