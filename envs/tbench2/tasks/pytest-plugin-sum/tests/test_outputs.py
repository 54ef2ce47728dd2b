def test_the_tests_plugin_is_loaded(pytestconfig):
    assert pytestconfig.pluginmanager.has_plugin("sumcheck")


def test_sum_is_written(expected_sum):
    with open("/app/sum.txt") as fh:
        assert fh.read() == f"{expected_sum}\n"
