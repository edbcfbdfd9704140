"""Text for users: option lists split at top-level commas, a type named with its article."""

import numpy as np
import optax
import pytest

from mpmdc._text import a_type, split_top_level


def test_split_top_level_keeps_bracketed_commas():
    assert split_top_level("a,b{x=1,y=2},c", "{}") == ["a", "b{x=1,y=2}", "c"]
    with pytest.raises(ValueError, match="unbalanced"):
        split_top_level("a{b", "{}")


@pytest.mark.parametrize(
    "value, text",
    [
        (optax.EmptyState(), "an EmptyState"),
        (object(), "an object"),
        ([], "a list"),
        (np.zeros(1), "an ndarray"),
        (np.uint8(1), "a uint8"),
    ],
)
def test_a_type_takes_the_article_its_name_starts_with(value, text):
    assert a_type(value) == text
