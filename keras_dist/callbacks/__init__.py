"""Keras callbacks of keras_dist that watch a run (`keras_dist.callbacks`)."""

from keras_dist.callbacks.throughput import Throughput

__all__ = ["Throughput"]
