"""The browser console in a real headless Chromium (Debian's, driven by Playwright; no
browser download): a WAV file is the microphone, the echo model answers through
`duplex serve`, the page plays it and acknowledges playback, and a dropped connection
resumes with the event seq contiguous. A screenshot lands in test-artifacts/."""

import contextlib
import re
import shutil
import wave
from pathlib import Path

import pytest

from harness.processes import start_serve

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SPEECH = ROOT / "harness" / "data" / "speech_16k.wav"  # "Hello there, can you hear me?"
ARTIFACTS = ROOT / "test-artifacts"
API_KEY = "console-test-key"

pytestmark = pytest.mark.skipif(
    not Path(CHROMIUM).exists(), reason="Debian chromium is missing (make test installs it)"
)


def microphone_wav(path: Path) -> Path:
    """The speech then 4 s of silence: Chromium loops the file; server VAD needs silence to
    end each turn, and the echo (as long as the speech) is played in full before the next
    repetition would barge in."""
    with wave.open(str(SPEECH)) as source:
        params, frames = source.getparams(), source.readframes(source.getnframes())
    with wave.open(str(path), "wb") as target:
        target.setparams(params)
        target.writeframes(frames + bytes(int(4 * params.framerate) * params.sampwidth))
    return path


FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--autoplay-policy=no-user-gesture-required",
    "--use-fake-ui-for-media-stream",
    "--use-fake-device-for-media-stream",
]


@pytest.fixture(scope="module")
def server():
    process = start_serve("serve-console", DUPLEX_API_KEYS=API_KEY)
    try:
        process.wait_ready(headers={"Authorization": f"Bearer {API_KEY}"})
        yield process
    finally:
        process.stop()


@contextlib.contextmanager
def console(base: str, microphone: Path, screenshot: str):
    from playwright.sync_api import sync_playwright

    flags = [*FLAGS, f"--use-file-for-fake-audio-capture={microphone}"]
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=flags)
        # bypass_csp: Playwright evaluates its wait conditions with eval(), which the
        # console's Content-Security-Policy forbids (tests/e2e/test_hostile_http.py loads
        # the console under the policy and checks it works there)
        page = browser.new_page(viewport={"width": 1280, "height": 800}, bypass_csp=True)
        page.goto(base + "/")
        try:
            yield page
        finally:
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / screenshot))
            browser.close()


@pytest.fixture
def page(server, tmp_path):
    microphone = microphone_wav(tmp_path / "microphone.wav")
    with console(server.base, microphone, "console.png") as page:
        yield page


def wait(page, condition: str, timeout_s: float = 30) -> None:
    page.wait_for_function(condition, timeout=timeout_s * 1000)


#: counts the page's microphone requests (an init script runs before the page's own)
COUNT_MICROPHONE_REQUESTS = """
window.microphoneRequests = 0;
const getUserMedia = navigator.mediaDevices.getUserMedia.bind(navigator.mediaDevices);
navigator.mediaDevices.getUserMedia = (constraints) => {
  window.microphoneRequests += 1;
  return getUserMedia(constraints);
};
"""
PLACEHOLDERS = ("#state-empty", "#turns-empty", "#log-empty")


def test_the_page_says_what_it_will_do_before_asking_for_the_microphone(server, tmp_path):
    """A newcomer found three empty panels and no word of the microphone (issue 26): before
    anything is pressed the page says it will ask for the microphone, and each panel says
    what it will show; the microphone is asked for only on Connect + talk."""
    from playwright.sync_api import sync_playwright

    microphone = microphone_wav(tmp_path / "microphone.wav")
    flags = [*FLAGS, f"--use-file-for-fake-audio-capture={microphone}"]
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=flags)
        try:
            page = browser.new_page(bypass_csp=True)
            page.add_init_script(COUNT_MICROPHONE_REQUESTS)
            page.goto(server.base + "/")
            wait(page, "window.consoleState.status.startsWith('models: enter')")
            intro = page.inner_text("#intro")
            assert "microphone" in intro and "Connect + talk" in intro
            for placeholder in PLACEHOLDERS:
                assert page.is_visible(placeholder) and page.inner_text(placeholder).strip()
            assert page.evaluate("window.microphoneRequests") == 0

            page.fill("#api-key", API_KEY)
            page.dispatch_event("#api-key", "change")
            wait(page, "document.querySelector('#model').options.length > 0")
            page.click("#connect")
            wait(page, "window.consoleState.sessionId !== null")
            assert page.evaluate("window.microphoneRequests") == 1
            # the panels that have something to show drop their placeholder
            assert not page.is_visible("#state-empty") and not page.is_visible("#log-empty")
        finally:
            browser.close()


def test_talk_hear_the_echo_drop_and_resume(page):
    state = "window.consoleState"
    wait(page, f"{state}.status.startsWith('models: enter')")  # /v1/models needs the key
    page.fill("#api-key", API_KEY)
    page.dispatch_event("#api-key", "change")
    wait(page, "document.querySelector('#model').options.length > 0")
    assert page.input_value("#model") == "echo"
    page.click("#connect")  # the key goes as a WebSocket subprotocol

    # the fake microphone speaks; server VAD ends the turn; echo answers; the page plays it
    wait(page, f"{state}.assistantTranscripts.length > 0")
    wait(page, f"{state}.playedMs > 500")
    first = page.evaluate(state)
    assert re.fullmatch(r"echo \d+ ms", first["assistantTranscripts"][0])
    assert first["micSentMs"] > 1000 and first["sessionId"].startswith("duplex-")
    played = [r for r in first["responses"].values() if r["playedMs"] > 0]
    assert played  # playback.ack reported what was played
    assert "echo" in page.inner_text("#turns") and "(speech)" in page.inner_text("#turns")
    assert not [p for p in PLACEHOLDERS if page.is_visible(p)]
    assert first["worker"] and page.inner_text("#s-worker") == first["worker"]
    assert page.inner_text("#s-epoch").split(" / ")[1] != "0"  # the turn counter moved

    # drop the connection, then resume with the stored token and last seq
    page.click("#drop")
    wait(page, f"!{state}.connected")
    page.wait_for_timeout(1500)  # the session goes on producing events meanwhile
    page.click("#resume")
    wait(page, f"{state}.resumes === 1 && {state}.connected")
    seq = page.evaluate(f"{state}.lastSeq")
    wait(page, f"{state}.lastSeq > {seq + 10}")  # live again after the replay
    after = page.evaluate(state)
    assert after["seqGaps"] == 0 and after["generation"] == 2
    assert after["errors"] == [], after["errors"]
    assert "session.resumed" in after["eventTypes"]
    assert page.inner_text("#s-gaps") == "0"


def test_talk_to_the_assistant(tmp_path):
    """`duplex serve --plugin assistant`: the page shows what it heard and what it said."""
    from harness.speech import spoken

    audio = (spoken("hello", lead_s=0.5, tail_s=6.0) * 32767).astype("<i2").tobytes()
    microphone = tmp_path / "hello.wav"
    with wave.open(str(microphone), "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(16000)
        wav.writeframes(audio)
    process = start_serve("serve-console-assistant", ("--plugin", "assistant"))
    try:
        process.wait_ready()
        with console(process.base, microphone, "console-assistant.png") as page:
            wait(page, "document.querySelector('#model').options.length > 0")
            page.click("#connect")
            wait(page, "window.consoleState.assistantTranscripts.length > 0")
            state = page.evaluate("window.consoleState")
            assert "hello" in state["userTranscripts"][0]
            assert state["assistantTranscripts"][0] == "Hello! How can I help you?"
            turns = page.inner_text("#turns")
            assert "hello" in turns and "How can I help you?" in turns
    finally:
        process.stop()
