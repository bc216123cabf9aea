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


def branches_on_data(x):
    if x.sum() > 0:  # data-dependent control flow: a graph break (under fullgraph, Dynamo raises)
        return x * 2
    return x


def branches_on_item(x):
    if x.sum().item() > 0:  # a guard on a data-dependent value (under fullgraph, Dynamo raises a UserError)
        return x * 2
    return x


SECTION, KEY = "a_rather_long_configuration_section_name", "an_even_longer_nested_scale_factor_key_name"


def per_nested_value(x, options):
    return x * options[SECTION][KEY]  # a guard on the nested int, its path over 100 characters


def same_shape_new_nested_ints():
    return [((torch.randn(8), {SECTION: {KEY: k}}), {}) for k in (2, 3)]


def breaks_in_a_loop(x):
    for _ in range(2):
        x = x + 1
        torch._dynamo.graph_break()  # a break inside a loop: Dynamo runs the whole frame eager
    return x


def per_count(x, count: int):
    for _ in range(count):  # Dynamo unrolls the loop: a graph per count, however dynamic the int
        x = x * 2
    return x


def twelve_counts():
    return [((torch.randn(8), count), {}) for count in range(1, 13)]


def per_length(x):
    for _ in range(x.shape[0]):  # the same over a shape: a graph per length
        x = x + 1
    return x


def twelve_lengths():
    return [((torch.randn(n),), {}) for n in range(1, 13)]
