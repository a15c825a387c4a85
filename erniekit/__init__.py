"""erniekit: a PaddlePaddle-native toolkit for the ERNIE 4.5 model family."""

__version__ = "0.1.0"
