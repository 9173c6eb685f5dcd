"""AIVEDIO_EVENT_QUEUES maps event types to SQS queue URLs for the relay Lambda."""
import pytest

from aivedio.config import ConfigError, settings_from_env


def test_unset_means_no_queues():
    assert settings_from_env({}).event_queue_urls == {}


def test_json_object_is_read():
    s = settings_from_env({"AIVEDIO_EVENT_QUEUES": '{"task.created": "https://sqs/q1", "*": "https://sqs/all"}'})
    assert s.event_queue_urls == {"task.created": "https://sqs/q1", "*": "https://sqs/all"}


@pytest.mark.parametrize("raw,needle", [("{not json", "not valid JSON"), ('["a"]', "JSON object"), ('{"a": 1}', "JSON object")])
def test_bad_value_fails_with_one_line_naming_the_variable(raw, needle):
    with pytest.raises(ConfigError) as e:
        settings_from_env({"AIVEDIO_EVENT_QUEUES": raw})
    assert str(e.value).startswith("AIVEDIO_EVENT_QUEUES:") and needle in str(e.value) and "\n" not in str(e.value)
