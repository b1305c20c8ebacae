"""An app's display name becomes its Xcode target name: accented letters keep their base letter (the issue's
case: 'My "Demo": Ünïcode #1' was MyDemoNCode1), letters without an ASCII base fall away."""

from __future__ import annotations

import pytest

from kvrig.appgen.render import product_name


@pytest.mark.parametrize(
    ("name", "target"),
    [
        ('My "Demo": Ünïcode #1', "MyDemoUnicode1"),
        ("Café Crème", "CafeCreme"),
        ("Ångström ﬁle", "AngstromFile"),
        ("日本語", "App"),
    ],
)
def test_accented_letters_keep_their_base(name: str, target: str) -> None:
    assert product_name(name) == target
