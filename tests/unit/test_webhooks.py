"""Standard Webhooks signatures: the published test vector, timestamp tolerance on both sides,
several signatures in one header, and every kind of tampering refused."""
import base64
from datetime import datetime, timezone

import pytest

from aivedio.providers.webhooks import decode_secret, sign_webhook, signature, verify_webhook

# The Standard Webhooks reference vector (the same in every reference library's tests).
VECTOR_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
VECTOR_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
VECTOR_TS = 1614265330
VECTOR_BODY = b'{"test": 2432232314}'
VECTOR_SIG = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="

SECRET = "whsec_" + base64.b64encode(b"a-test-secret-of-some-length").decode()
NOW = 1_700_000_000
BODY = b'{"type":"job.succeeded","data":{"id":"job_1","status":"succeeded"}}'


def signed(body=BODY, ts=NOW, msg_id="msg_1", secret=SECRET):
    return sign_webhook(secret, msg_id, ts, body)


def test_the_published_vector_signs_and_verifies():
    assert signature(VECTOR_SECRET, VECTOR_ID, VECTOR_TS, VECTOR_BODY) == VECTOR_SIG
    headers = {"webhook-id": VECTOR_ID, "webhook-timestamp": str(VECTOR_TS), "webhook-signature": VECTOR_SIG}
    assert verify_webhook(VECTOR_SECRET, headers, VECTOR_BODY, now=VECTOR_TS)
    assert sign_webhook(VECTOR_SECRET, VECTOR_ID, VECTOR_TS, VECTOR_BODY) == headers


def test_the_key_is_the_base64_after_whsec_and_the_prefix_is_optional():
    assert decode_secret(VECTOR_SECRET) == base64.b64decode("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
    assert signature(VECTOR_SECRET.removeprefix("whsec_"), VECTOR_ID, VECTOR_TS, VECTOR_BODY) == VECTOR_SIG
    for bad in ("whsec_not base64!", "whsec_"):
        with pytest.raises(ValueError):
            decode_secret(bad)


def test_a_signed_message_verifies_and_str_or_bytes_bodies_agree():
    h = signed()
    assert verify_webhook(SECRET, h, BODY, now=NOW)
    assert verify_webhook(SECRET, h, BODY.decode(), now=NOW)
    assert h["webhook-signature"].startswith("v1,")
    assert verify_webhook(SECRET, h, BODY, now=datetime.fromtimestamp(NOW, timezone.utc))


def test_header_names_are_case_insensitive_and_pairs_work():
    h = signed()
    assert verify_webhook(SECRET, {k.title(): v for k, v in h.items()}, BODY, now=NOW)
    assert verify_webhook(SECRET, [(k.upper(), v) for k, v in h.items()], BODY, now=NOW)


@pytest.mark.parametrize("skew, ok", [(0, True), (299, True), (300, True), (301, False), (-300, True), (-301, False),
                                      (86400, False), (-86400, False)])
def test_timestamp_tolerance_is_five_minutes_either_side(skew, ok):
    assert verify_webhook(SECRET, signed(), BODY, now=NOW + skew) is ok


def test_tolerance_is_configurable():
    assert not verify_webhook(SECRET, signed(), BODY, now=NOW + 61, tolerance_seconds=60)
    assert verify_webhook(SECRET, signed(), BODY, now=NOW + 600, tolerance_seconds=900)


def test_any_one_of_several_signatures_suffices():
    good = signed()["webhook-signature"]
    other = signature("whsec_" + base64.b64encode(b"the-rotated-out-key").decode(), "msg_1", NOW, BODY)
    for header in (f"{other} {good}", f"{good} {other}", f"v1a,c29tZXRoaW5n {good}", f"v2,xyz  {good}"):
        h = {**signed(), "webhook-signature": header}
        assert verify_webhook(SECRET, h, BODY, now=NOW), header
    h = {**signed(), "webhook-signature": f"{other} v1a,{good[3:]} v1,"}
    assert not verify_webhook(SECRET, h, BODY, now=NOW)


def test_a_v1_signature_under_another_version_label_is_refused():
    good = signed()["webhook-signature"]
    assert not verify_webhook(SECRET, {**signed(), "webhook-signature": "v2," + good[3:]}, BODY, now=NOW)


@pytest.mark.parametrize("tamper", ["body", "id", "timestamp", "signature", "secret", "whitespace"])
def test_tampering_is_refused(tamper):
    h, body, secret = dict(signed()), BODY, SECRET
    if tamper == "body":
        body = BODY.replace(b"succeeded", b"failed")
    elif tamper == "id":
        h["webhook-id"] = "msg_2"
    elif tamper == "timestamp":
        h["webhook-timestamp"] = str(NOW + 1)
    elif tamper == "signature":
        raw = bytearray(base64.b64decode(h["webhook-signature"][3:]))
        raw[0] ^= 1
        h["webhook-signature"] = "v1," + base64.b64encode(bytes(raw)).decode()
    elif tamper == "secret":
        secret = "whsec_" + base64.b64encode(b"someone-else").decode()
    elif tamper == "whitespace":
        body = BODY + b" "
    assert not verify_webhook(secret, h, body, now=NOW)


@pytest.mark.parametrize("missing", ["webhook-id", "webhook-timestamp", "webhook-signature"])
def test_a_missing_header_is_refused(missing):
    h = {k: v for k, v in signed().items() if k != missing}
    assert not verify_webhook(SECRET, h, BODY, now=NOW)


@pytest.mark.parametrize("ts", ["", "abc", "1.5", "-1", " 1700000000", "１７００", "1" * 5000, "0" * 13])
def test_a_malformed_timestamp_is_refused(ts):
    h = {**signed(), "webhook-timestamp": ts}
    assert not verify_webhook(SECRET, h, BODY, now=NOW)


def test_a_naive_now_is_a_programming_error():
    with pytest.raises(ValueError):
        verify_webhook(SECRET, signed(), BODY, now=datetime(2024, 1, 1))
