"""Toy callables and input factories for the audit tool's own tests."""

import torch


def with_item(x):
    n = int((x > 0).sum().item())  # a device->host sync fullgraph=True captures silently
    return x[:n].sum()


def per_value(x, scale: int):
    return x * scale  # Dynamo guards on the int: a recompile per value, same shapes


def clean(x, mask):
    return torch.where(mask, x, 0.0).sum()


def eight_floats():
    return [((torch.randn(8),), {}) for _ in range(3)]


def same_shape_new_ints():
    return [((torch.randn(8), k), {}) for k in (2, 3, 4)]


def masked_samples():
    return [((torch.randn(n), torch.rand(n) > 0.5), {}) for n in (8, 8, 16, 16, 8)]
