"""Flat names of state-dict leaves agree with the names stock DCP stores them under."""

import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st

from dist_checkpointing._fqn import fqn_of, iter_fqn_leaves

leaves = st.one_of(
    st.integers(-3, 3),
    st.text("ab", max_size=2),
    st.just(torch.ones(1)),
    st.tuples(st.integers(0, 2)),
)
trees = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(
            st.one_of(st.text("xyz", min_size=1, max_size=2), st.integers(0, 3)), inner, max_size=3
        ),
    ),
    max_leaves=8,
)


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.text("pq", min_size=1, max_size=2), trees, min_size=1, max_size=3))
def test_flat_names_are_the_names_dcp_stores_leaves_under(tmp_path_factory, state):
    names = [fqn_of(p) for p, _ in iter_fqn_leaves(state)]
    if len(set(names)) != len(names):  # DCP refuses such a state itself
        return
    path = tmp_path_factory.mktemp("dcp")
    dcp.save(state, checkpoint_id=path, no_dist=True)
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    assert sorted(stored) == sorted(names)
