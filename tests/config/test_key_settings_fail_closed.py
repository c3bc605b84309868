"""A typo in a key setting must not start the gateway open: a name that looks like
`FIRSTTOKEN_TENANT_KEYS` or `FIRSTTOKEN_ADMIN_KEYS` but is not one, in the environment or in a
config file, and a key list that holds no key, each stop the start with a message naming it."""

from __future__ import annotations

import pytest

from gateway.config.settings import SettingsError, load_settings

KEYS = "acme:sk-acme-1"


@pytest.mark.parametrize(
    "name,meant",
    [
        ("FIRSTTOKEN_TENANT_KEY", "FIRSTTOKEN_TENANT_KEYS"),
        ("FIRSTTOKEN_TENNANT_KEYS", "FIRSTTOKEN_TENANT_KEYS"),
        ("FIRSTTOKEN_TENANTS_KEYS", "FIRSTTOKEN_TENANT_KEYS"),
        ("FIRSTTOKEN_TENANT_API_KEYS", "FIRSTTOKEN_TENANT_KEYS"),
        ("FIRSTTOKEN_API_KEYS", "FIRSTTOKEN_TENANT_KEYS"),
        ("FIRSTTOKEN_ADMIN_KEY", "FIRSTTOKEN_ADMIN_KEYS"),
        ("firsttoken_admin_keyz", "FIRSTTOKEN_ADMIN_KEYS"),
    ],
)
def test_a_near_miss_of_a_key_setting_in_the_environment_stops_the_start(name, meant):
    with pytest.raises(SettingsError) as err:
        load_settings(environ={name: KEYS})
    message = str(err.value)
    assert message.startswith(f"{name}:") and f"did you mean {meant}?" in message
    assert "sk-acme-1" not in message  # the value is a key: never echoed


@pytest.mark.parametrize("key,meant", [("tenant_key", "tenant_keys"), ("admin_key", "admin_keys")])
def test_a_near_miss_in_the_config_file_stops_the_start(tmp_path, key, meant):
    path = tmp_path / "gateway.toml"
    path.write_text(f'{key} = "{KEYS}"\n')
    with pytest.raises(SettingsError) as err:
        load_settings(environ={}, config_file=path)
    message = str(err.value)
    assert message.startswith(f"{key!r} in {path}:") and f"did you mean {meant}?" in message


def test_the_near_miss_stops_the_start_even_beside_the_right_setting():
    """Both set: the operator may believe the misspelt one adds keys (say, the admin's)."""
    with pytest.raises(SettingsError, match="FIRSTTOKEN_ADMIN_KEY:"):
        load_settings(environ={"FIRSTTOKEN_TENANT_KEYS": KEYS, "FIRSTTOKEN_ADMIN_KEY": "sk-admin"})


@pytest.mark.parametrize("variable", ["FIRSTTOKEN_TENANT_KEYS", "FIRSTTOKEN_ADMIN_KEYS"])
@pytest.mark.parametrize("value", [" ,", ",", "", "  ", " , ,\t"])
def test_a_key_list_that_holds_no_key_stops_the_start(variable, value):
    with pytest.raises(SettingsError) as err:
        load_settings(environ={variable: value})
    assert str(err.value).startswith(f"{variable}:") and "no key" in str(err.value)


def test_real_settings_and_other_typos_still_start():
    """A real setting with KEY in its name loads; a typo of any other setting only warns."""
    settings = load_settings(
        environ={
            "FIRSTTOKEN_TENANT_KEYS": KEYS,
            "FIRSTTOKEN_METRICS_KEY_PREFIX": "ft",
            "FIRSTTOKEN_TIMEOUT": "5",
            "FIRSTTOKEN_KEYPAD": "1",
        }
    )
    assert settings.tenant_keys and settings.metrics_key_prefix == "ft"
    assert settings.timeout_s == 600
