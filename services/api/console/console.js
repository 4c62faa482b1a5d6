// The duplex-serve console: talk to a served model from a browser.
//
// Microphone -> AudioWorklet at 16 kHz -> 20 ms pcm16 appends; model audio -> gapless
// playback at 24 kHz, reported back with playback.ack (what was actually played);
// barge-in (button, or automatic when server VAD hears speech); transcripts; the event
// log; the live session state; drop the connection and resume with the stored token and
// last seq. Plain JavaScript, no build step. `window.consoleState` is what the tests read.

const $ = (id) => document.getElementById(id);
const OUTPUT_RATE = 24000;
const ACK_EVERY = 50;

const state = (window.consoleState = {
  status: "disconnected",
  connected: false,
  dropped: false,
  sessionId: null,
  resumeToken: null,
  session: {},
  generation: 0,
  worker: null,
  lastSeq: 0,
  seqGaps: 0,
  duplicates: 0,
  resumes: 0,
  micSentMs: 0,
  micLevel: 0,
  playedMs: 0,
  userTranscripts: [],
  assistantTranscripts: [],
  responses: {}, // id -> {status, reason, playedMs, transcript}
  eventTypes: [],
  errors: [],
});

let ws = null;
let micContext = null; // (window.consoleAudio exposes both contexts for debugging)
let playContext = null;
let nextPlayAt = 0;
let playing = []; // scheduled AudioBufferSourceNodes
let currentResponse = null;
let unacked = 0;

// ------------------------------------------------------------------ UI helpers

function setStatus(text) {
  state.status = text;
  $("status").textContent = text;
}

function buttons() {
  const live = state.connected;
  $("connect").disabled = live || state.dropped;
  $("disconnect").disabled = !live;
  $("barge-in").disabled = !live;
  $("drop").disabled = !live;
  $("resume").disabled = live || !state.dropped;
}

function renderState() {
  document.body.classList.toggle("has-session", Boolean(state.sessionId));
  const s = state.session || {};
  $("s-id").textContent = state.sessionId || "-";
  $("s-state").textContent = `${s.state ?? "-"} / ${s.turn_state ?? "-"}`;
  $("s-epoch").textContent = `${s.epoch ?? "-"} / ${s.turn_id ?? "-"}`;
  $("s-seq").textContent = state.lastSeq;
  $("s-gaps").textContent = state.seqGaps;
  $("s-generation").textContent = state.generation || "-";
  $("s-resumes").textContent = state.resumes;
  $("s-worker").textContent = state.worker || "-";
  $("s-sent").textContent = `${state.micSentMs} ms (level ${state.micLevel.toFixed(2)})`;
  $("s-played").textContent = `${Math.round(state.playedMs)} ms`;
}

function logEvent(event, direction) {
  state.eventTypes.push(event.type);
  const item = document.createElement("li");
  item.className = direction + (event.type === "error" ? " error" : "");
  const seq = event.server_event_seq ? `#${event.server_event_seq} ` : "";
  const detail = event.type === "error" ? ` ${event.error?.code}: ${event.error?.message}` : "";
  item.textContent = `${direction === "in" ? "<-" : "->"} ${seq}${event.type}${detail}`;
  const log = $("log");
  log.prepend(item);
  while (log.children.length > 200) log.lastChild.remove();
}

function turnLine(who, text, id) {
  const item = document.createElement("li");
  item.className = who;
  if (id) item.dataset.id = id;
  item.innerHTML = `<b>${who === "user" ? "you" : "model"}</b> <span></span>`;
  item.querySelector("span").textContent = text;
  $("turns").append(item);
  item.scrollIntoView({ block: "nearest" });
  return item;
}

function responseLine(id) {
  return document.querySelector(`#turns li[data-id="${id}"]`) || turnLine("model", "", id);
}

// ------------------------------------------------------------------ socket

function socketUrl(resume) {
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  const query = resume ? "duplex=1&autostart=0" : "duplex=1";
  return `${scheme}://${location.host}/v1/realtime?${query}`;
}

function protocols() {
  // browsers cannot set an Authorization header on a WebSocket: the key travels as a
  // subprotocol (the OpenAI convention), which the server accepts
  const key = $("api-key").value.trim();
  return key ? ["realtime", `openai-insecure-api-key.${key}`] : ["realtime"];
}

function send(event) {
  if (!ws || ws.readyState !== WebSocket.OPEN) return false;
  ws.send(JSON.stringify(event));
  if (event.type !== "input_audio_buffer.append") logEvent(event, "out");
  return true;
}

function openSocket(resume) {
  return new Promise((resolve, reject) => {
    ws = new WebSocket(socketUrl(resume), protocols());
    ws.onopen = () => {
      state.connected = true;
      state.dropped = false;
      buttons();
      resolve();
    };
    ws.onerror = () => reject(new Error("WebSocket failed"));
    ws.onmessage = (message) => onEvent(JSON.parse(message.data));
    ws.onclose = (event) => {
      state.connected = false;
      setStatus(`socket closed (${event.code}${event.reason ? ": " + event.reason : ""})`);
      buttons();
    };
  });
}

// ------------------------------------------------------------------ server events

function trackSeq(event) {
  const seq = event.server_event_seq;
  if (!seq) return true;
  if (seq <= state.lastSeq) {
    state.duplicates += 1; // a replay overlapping what we had: drop it
    return false;
  }
  if (state.lastSeq && seq !== state.lastSeq + 1) state.seqGaps += seq - state.lastSeq - 1;
  state.lastSeq = seq;
  if (++unacked >= ACK_EVERY) {
    unacked = 0;
    send({ type: "session.event_ack", server_event_seq: seq });
  }
  return true;
}

function onEvent(event) {
  if (!trackSeq(event)) return;
  logEvent(event, "in");
  switch (event.type) {
    case "session.created":
    case "session.resumed":
      state.sessionId = event.session?.id || event.session_id || state.sessionId;
      state.resumeToken = event.resume_token || state.resumeToken;
      state.generation = event.attachment_generation || state.generation;
      state.session = event.session || state.session;
      state.worker = event.duplex_worker_id || state.worker; // the worker that opened it (a drain or failover may move the session: docs/wire-api.md)
      if (event.type === "session.resumed") state.resumes += 1;
      setStatus(event.type === "session.resumed" ? "resumed" : "talking");
      break;
    case "session.updated":
      state.session = event.session || state.session;
      break;
    case "input_audio_buffer.speech_started":
      if ($("auto-barge").checked && playing.length) stopPlayback();
      break;
    case "input_audio_buffer.committed": {
      const turn = event.event || {};
      state.session = { ...state.session, epoch: turn.epoch, turn_id: turn.turn_id };
      turnLine("user", "(speech)", event.item_id); // the transcript replaces it, if any
      break;
    }
    case "conversation.item.input_audio_transcription.completed": {
      state.userTranscripts.push(event.transcript);
      const line = document.querySelector(`#turns li[data-id="${event.item_id}"] span`);
      if (line) line.textContent = event.transcript;
      else turnLine("user", event.transcript, event.item_id);
      break;
    }
    case "response.created": {
      const fence = event.response.metadata?.duplex_event;
      if (fence) state.session = { ...state.session, epoch: fence.epoch, turn_id: fence.turn_id };
      currentResponse = event.response.id;
      state.responses[currentResponse] = { status: "in_progress", playedMs: 0, transcript: "" };
      responseLine(currentResponse);
      break;
    }
    case "response.output_audio.delta":
      schedule(event.delta, event.response_id);
      break;
    case "response.output_audio_transcript.delta": {
      const line = responseLine(event.response_id).querySelector("span");
      line.textContent += event.delta;
      break;
    }
    case "response.output_audio_transcript.done":
      state.assistantTranscripts.push(event.transcript);
      responseLine(event.response_id).querySelector("span").textContent = event.transcript;
      if (state.responses[event.response_id]) {
        state.responses[event.response_id].transcript = event.transcript;
      }
      break;
    case "response.done": {
      const response = event.response || {};
      const entry = state.responses[response.id] || {};
      entry.status = response.status;
      entry.reason = response.status_details?.reason;
      state.responses[response.id] = entry;
      if (response.status !== "completed") {
        responseLine(response.id).classList.add("cancelled");
        stopPlayback();
      }
      break;
    }
    case "error":
      state.errors.push(event.error?.code);
      break;
    case "session.closed":
    case "session.expired":
      setStatus(`${event.type}: ${event.reason}`);
      stopMicrophone();
      break;
  }
  renderState();
}

// ------------------------------------------------------------------ audio

function base64ToInt16(b64) {
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  return new Int16Array(bytes.buffer, 0, bytes.length >> 1);
}

function int16ToBase64(buffer) {
  const bytes = new Uint8Array(buffer);
  let text = "";
  for (let i = 0; i < bytes.length; i++) text += String.fromCharCode(bytes[i]);
  return btoa(text);
}

function schedule(b64, responseId) {
  const pcm = base64ToInt16(b64);
  if (!pcm.length) return;
  const samples = new Float32Array(pcm.length);
  for (let i = 0; i < pcm.length; i++) samples[i] = pcm[i] / 32768;
  const buffer = playContext.createBuffer(1, samples.length, OUTPUT_RATE);
  buffer.copyToChannel(samples, 0);
  const source = playContext.createBufferSource();
  source.buffer = buffer;
  source.connect(playContext.destination);
  const at = Math.max(playContext.currentTime + 0.03, nextPlayAt); // gapless: back to back
  source.start(at);
  nextPlayAt = at + buffer.duration;
  playing.push(source);
  source.onended = () => {
    playing = playing.filter((s) => s !== source);
    if (source.stopped) return;
    const ms = buffer.duration * 1000;
    state.playedMs += ms;
    const entry = state.responses[responseId];
    if (entry) {
      entry.playedMs += ms;
      send({ type: "playback.ack", response_id: responseId, played_ms: Math.round(entry.playedMs) });
    }
    renderState();
  };
}

function stopPlayback() {
  for (const source of playing) {
    source.stopped = true;
    try {
      source.stop();
    } catch (_) {
      /* not started yet */
    }
  }
  playing = [];
  nextPlayAt = 0;
}

async function startAudio() {
  playContext = playContext || new AudioContext({ sampleRate: OUTPUT_RATE });
  await playContext.resume();
  if (micContext) return;
  micContext = new AudioContext({ sampleRate: 16000 }); // the browser resamples the mic
  await micContext.audioWorklet.addModule("/console/worklets.js");
  const stream = await navigator.mediaDevices.getUserMedia({
    audio: { echoCancellation: true, noiseSuppression: true, channelCount: 1 },
  });
  const source = micContext.createMediaStreamSource(stream);
  const capture = new AudioWorkletNode(micContext, "capture");
  const mute = micContext.createGain();
  mute.gain.value = 0; // pulled by the graph, heard by nobody
  source.connect(capture).connect(mute).connect(micContext.destination);
  capture.port.onmessage = (message) => {
    const frame = new Int16Array(message.data);
    let peak = 0;
    for (let i = 0; i < frame.length; i++) peak = Math.max(peak, Math.abs(frame[i]));
    state.micLevel = Math.max(peak / 32768, state.micLevel * 0.9); // a decaying peak meter
    if (!state.connected) return;
    if (send({ type: "input_audio_buffer.append", audio: int16ToBase64(message.data) })) {
      state.micSentMs += 20;
    }
  };
  micContext.stream = stream;
  window.consoleAudio = { micContext, playContext };
}

function stopMicrophone() {
  if (!micContext) return;
  micContext.stream?.getTracks().forEach((track) => track.stop());
  micContext.close();
  micContext = null;
}

// ------------------------------------------------------------------ controls

async function loadModels() {
  const key = $("api-key").value.trim();
  const headers = key ? { Authorization: `Bearer ${key}` } : {};
  try {
    const reply = await fetch("/v1/models", { headers });
    if (!reply.ok) throw new Error(reply.status === 401 ? "enter the API key" : reply.statusText);
    const models = (await reply.json()).data || [];
    $("model").replaceChildren(
      ...models.map((m) => Object.assign(document.createElement("option"), { textContent: m.id })),
    );
    setStatus(`${models.length} model(s)`);
  } catch (error) {
    setStatus(`models: ${error.message}`);
  }
}

function microphoneProblem(error) {
  // getUserMedia's refusals, said so that the next step is plain
  if (error.name === "NotAllowedError") {
    return "the microphone was not allowed: allow it for this page, then press Connect + talk";
  }
  if (error.name === "NotFoundError") return "no microphone found";
  return null;
}

async function connect(event) {
  event.preventDefault();
  if (!$("model").value) await loadModels();
  try {
    await startAudio();
    await openSocket(false);
  } catch (error) {
    setStatus(`cannot connect: ${microphoneProblem(error) || error.message}`);
    return;
  }
  send({
    type: "session.update",
    session: {
      model: $("model").value || undefined,
      audio: { input: { format: { type: "audio/pcm", rate: 16000 } } },
      turn_detection: { type: "server_vad" },
      playback_commit_policy: "ack_only",
    },
  });
}

function bargeIn() {
  stopPlayback();
  const caps = state.session?.capabilities || {};
  send(caps.supports_barge_in ? { type: "barge_in" } : { type: "response.cancel" });
}

function drop() {
  state.dropped = true;
  ws.close(4000, "dropped by the console"); // no session.close: the session waits for us
  stopPlayback();
  setStatus("dropped: the session waits (disconnect grace)");
  buttons();
}

async function resume() {
  try {
    await openSocket(true);
  } catch (error) {
    setStatus(`resume failed: ${error.message}`);
    return;
  }
  send({
    type: "session.resume",
    session_id: state.sessionId,
    resume_token: state.resumeToken,
    last_received_server_event_seq: state.lastSeq,
  });
}

function endSession() {
  send({ type: "session.close" });
}

$("connect-form").addEventListener("submit", connect);
$("disconnect").addEventListener("click", endSession);
$("barge-in").addEventListener("click", bargeIn);
$("drop").addEventListener("click", drop);
$("resume").addEventListener("click", resume);
$("api-key").addEventListener("change", loadModels);
loadModels();
buttons();
renderState();
