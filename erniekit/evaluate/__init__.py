"""Offline analyses of a trained checkpoint (`erniekit eval`): reports that run forward passes
over a dataset and write numbers and pictures, without training."""
