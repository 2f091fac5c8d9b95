"""Tests for meshtrain.mesh: MeshConfig sizes and parsing, make_mesh, simulate_devices."""

import os

import jax
import numpy as np
import pytest
from _helpers import count_compiles
from jax.sharding import AxisType

from meshtrain.mesh import AXES, MeshConfig, describe, make_mesh, mesh_sizes, simulate_devices

# --- MeshConfig ---------------------------------------------------------------------------


def test_default_fills_data_with_all_devices():
    assert MeshConfig().sizes(8) == dict(pipe=1, data=8, fsdp=1, expert=1, seq=1, tensor=1)


@pytest.mark.parametrize(
    "kwargs, filled",
    [
        (dict(tensor=2), ("data", 4)),
        (dict(data=2, fsdp=-1, tensor=2), ("fsdp", 2)),
        (dict(data=1, tensor=-1), ("tensor", 8)),
        (dict(data=2, fsdp=2, tensor=2), ("data", 2)),  # nothing to fill
    ],
)
def test_minus_one_takes_the_remaining_devices(kwargs, filled):
    sizes = MeshConfig(**kwargs).sizes(8)
    name, size = filled
    assert sizes[name] == size
    assert np.prod(list(sizes.values())) == 8
    for axis, value in kwargs.items():
        if value != -1:
            assert sizes[axis] == value


def test_fill_that_cannot_divide_is_an_error():
    with pytest.raises(ValueError, match=r"multiply to 3, which does not divide 8 devices"):
        MeshConfig(tensor=3).sizes(8)


@pytest.mark.parametrize(
    "text",
    ["data=8", "data=4,tensor=2", "data=2,fsdp=2,tensor=2", "pipe=2,data=-1", "fsdp=8", "data=-1"],
)
def test_parse_str_round_trip(text):
    config = MeshConfig.parse(text)
    assert str(config) == text
    assert MeshConfig.parse(str(config)) == config


def test_parse_sets_unnamed_axes_to_one_and_tolerates_spaces():
    config = MeshConfig.parse(" data = 4 , tensor=2 ")
    assert config == MeshConfig(pipe=1, data=4, fsdp=1, expert=1, seq=1, tensor=2)
    assert MeshConfig.parse("") == MeshConfig()


def test_auto_is_not_a_mesh_spelling():
    """'auto' is kept for an automatic planner; 'data=-1' already means all data."""
    with pytest.raises(ValueError, match=r"mesh 'auto': not a mesh; 'data=-1' puts every device"):
        MeshConfig.parse("auto")


def test_product_not_device_count_names_sizes_and_count():
    with pytest.raises(ValueError, match=r"data=3 × tensor=2 = 6 ≠ 8 devices"):
        MeshConfig.parse("data=3,tensor=2").sizes(8)
    with pytest.raises(ValueError, match=r"data=4 = 4 ≠ 8 devices"):
        MeshConfig.parse("data=4").sizes(8)


def test_make_mesh_product_error_fires_before_any_compile():
    with count_compiles() as compiles, pytest.raises(ValueError, match=r"= 6 ≠ 8 devices"):
        make_mesh("data=3,tensor=2")
    assert compiles == []


def test_compile_counter_sees_compiles():
    """Positive control for `count_compiles`: a fresh jit is counted."""
    with count_compiles() as compiles:
        jax.jit(lambda x: x * 3 - 1)(np.arange(5.0)).block_until_ready()
    assert len(compiles) >= 1


def test_two_fill_axes_is_an_error():
    with pytest.raises(ValueError, match=r"mesh='data=-1,tensor=-1': only one axis may be -1"):
        MeshConfig(data=-1, tensor=-1)
    with pytest.raises(ValueError, match=r"only one axis may be -1"):
        MeshConfig.parse("fsdp=-1,seq=-1")


def test_unknown_mesh_axis_is_an_error():
    with pytest.raises(ValueError, match=r"unknown mesh axis 'model'; mesh axes are pipe, data"):
        MeshConfig.parse("data=4,model=2")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(data=0), r"mesh\.data=0: must be a positive integer"),
        (dict(tensor=-2), r"mesh\.tensor=-2: must be a positive integer"),
        (dict(fsdp=2.0), r"mesh\.fsdp=2.0: must be a positive integer"),
        (dict(seq=True), r"mesh\.seq=True: must be a positive integer"),
    ],
)
def test_non_positive_or_non_integer_sizes_are_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MeshConfig(**kwargs)


@pytest.mark.parametrize(
    "text, match",
    [
        ("data=0", r"mesh\.data=0: must be a positive integer"),
        ("data=four", r"mesh data='four': size must be an integer"),
        ("data4", r"expected axis=size"),
    ],
)
def test_parse_rejects_bad_sizes(text, match):
    with pytest.raises(ValueError, match=match):
        MeshConfig.parse(text)


# --- make_mesh ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config", ["data=4,tensor=2", MeshConfig(data=2, fsdp=2, tensor=2), None, "fsdp=-1"]
)
def test_make_mesh_has_all_six_auto_axes(config):
    mesh = make_mesh(config)
    assert mesh.axis_names == AXES
    assert mesh.axis_types == (AxisType.Auto,) * len(AXES)
    assert mesh.devices.size == 8
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in jax.devices())
    expected = (
        MeshConfig.parse(config) if isinstance(config, str) else config or MeshConfig()
    ).sizes(8)
    assert mesh_sizes(mesh) == expected


def test_make_mesh_on_a_subset_of_devices():
    devices = jax.devices()[2:6]
    mesh = make_mesh("data=2,tensor=2", devices=devices)
    assert mesh.devices.shape == (1, 2, 1, 1, 1, 2)
    assert [d.id for d in mesh.devices.flat] == [d.id for d in devices]
    with pytest.raises(ValueError, match=r"= 8 ≠ 4 devices"):
        make_mesh("data=8", devices=devices)


def test_describe_names_the_used_axes():
    assert describe(make_mesh("data=4,tensor=2")) == "data=4 × tensor=2 (8 cpu devices)"


# --- simulate_devices ---------------------------------------------------------------------


def test_simulate_devices_is_a_no_op_once_jax_has_enough():
    flags = os.environ.get("XLA_FLAGS")
    simulate_devices(8)
    simulate_devices(2)
    assert jax.device_count() == 8
    assert os.environ.get("XLA_FLAGS") == flags


def test_simulate_devices_more_than_started_is_a_clear_error():
    with pytest.raises(ValueError, match=r"already started with 8 device\(s\).*cannot change"):
        simulate_devices(16)
    assert jax.device_count() == 8


@pytest.mark.parametrize("n", [0, -3, 2.5])
def test_simulate_devices_rejects_non_positive(n):
    with pytest.raises(ValueError, match=rf"n={n!r}: must be a positive integer"):
        simulate_devices(n)
