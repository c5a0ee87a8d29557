//! The control socket (`run --control PATH`): JSON lines over a Unix
//! socket, as QEMU's QMP and Cloud Hypervisor's `ch-remote` drive theirs.
//! A client sends one object per line, `{"command": "..."}` with the
//! command's fields, and reads one object back per line: `"ok": true` with
//! the result, or `"ok": false` with `"error"`. One client at a time; the
//! commands run in the order they come, each to its end.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::time::{Duration, Instant};

use migration::{MigrationError, MigrationReport, Mover, SnapshotKind, Target};
use reference_vmm::RunControl;
use reference_vmm::VcpuState;
use serde_json::{Value, json};

/// How long the vCPUs may take to park for `pause`.
const PAUSE_TIMEOUT: Duration = Duration::from_secs(5);
/// How often an idle server looks whether the run has ended.
const POLL: Duration = Duration::from_millis(50);
/// How long an answer may wait for a client that does not read.
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest command line taken; a longer one ends its connection.
const MAX_LINE: usize = 64 << 10;
/// What the commands are, for an unknown one's error.
const COMMANDS: &str = "status, stats, pause, resume, snapshot, migrate";

/// Turns a `migrate` command's `"to"` into a target (TLS as the command
/// line's options say).
pub type Targets = Box<dyn Fn(&str) -> Result<Target, String> + Send>;

/// The server: the run's controller, from its start to its end.
pub struct Server {
    listener: UnixListener,
    mover: Mover,
    targets: Targets,
    /// The vCPUs' states while `pause` holds them.
    paused: Option<Vec<VcpuState>>,
    started: Instant,
}

/// What a command did to the run.
enum Next {
    /// The guest runs (or stands paused) here still.
    Serve,
    /// The guest was handed over: nothing is left to control.
    Done,
}

impl Server {
    /// A server on `listener`, moving the guest with `mover`.
    pub fn new(listener: UnixListener, mover: Mover, targets: Targets) -> io::Result<Self> {
        listener.set_nonblocking(true)?;
        Ok(Self {
            listener,
            mover,
            targets,
            paused: None,
            started: Instant::now(),
        })
    }

    /// Serves clients until the run ends or the guest is handed over. A run
    /// asked to stop while paused is resumed, so its vCPUs can leave.
    pub fn serve(mut self, control: &RunControl) {
        loop {
            if self.ended(control) {
                return;
            }
            match self.listener.accept() {
                Ok((stream, _)) => {
                    if let Next::Done = self.session(stream, control) {
                        return;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    control.wait_for_end(POLL);
                }
                Err(e) => {
                    eprintln!("control: cannot accept a client: {e}");
                    control.wait_for_end(POLL);
                }
            }
        }
    }

    /// Whether the run is over or leaving (a paused one let go).
    fn ended(&mut self, control: &RunControl) -> bool {
        let over = control.stopping() || control.wait_for_end(Duration::ZERO);
        if over && self.paused.take().is_some() {
            control.resume();
        }
        over
    }

    /// One client's commands, a line each, until it leaves, sends a line
    /// too long or not JSON's, or the run ends.
    fn session(&mut self, stream: UnixStream, control: &RunControl) -> Next {
        let ready = stream
            .set_nonblocking(false)
            .and_then(|()| stream.set_read_timeout(Some(POLL)))
            .and_then(|()| stream.set_write_timeout(Some(WRITE_TIMEOUT)))
            .and_then(|()| stream.try_clone());
        let Ok(mut writer) = ready else {
            return Next::Serve;
        };
        let mut reader = BufReader::new(stream.take(u64::MAX));
        let mut line = Vec::new();
        loop {
            if self.ended(control) {
                return Next::Serve;
            }
            reader
                .get_mut()
                .set_limit((MAX_LINE - line.len()) as u64 + 1);
            match reader.read_until(b'\n', &mut line) {
                Ok(0) => return Next::Serve,
                Ok(_) if line.last() != Some(&b'\n') && line.len() > MAX_LINE => {
                    let error = format!("a command line is at most {MAX_LINE} bytes");
                    let _ = reply(&mut writer, &failure(error));
                    return Next::Serve;
                }
                Ok(_) if line.last() != Some(&b'\n') => continue,
                Ok(_) => {}
                Err(e) if is_timeout(&e) => continue,
                Err(_) => return Next::Serve,
            }
            let (answer, next) = self.execute(&line, control);
            line.clear();
            if reply(&mut writer, &answer).is_err() || matches!(next, Next::Done) {
                return next;
            }
        }
    }

    /// Runs one command line.
    fn execute(&mut self, line: &[u8], control: &RunControl) -> (Value, Next) {
        let request: Value = match serde_json::from_slice(line) {
            Ok(request @ Value::Object(_)) => request,
            Ok(_) => return (failure("a command is a JSON object".into()), Next::Serve),
            Err(e) => return (failure(format!("not JSON: {e}")), Next::Serve),
        };
        let field = |name: &str| request.get(name).and_then(Value::as_str);
        let answer = match field("command") {
            Some("status") => Ok(self.status(control)),
            Some("stats") => Ok(stats(control)),
            Some("pause") => self.pause(control),
            Some("resume") => self.resume(control),
            Some("snapshot") => match (field("path"), field("kind").map(str::parse)) {
                (Some(path), None) => self.snapshot(control, Path::new(path), SnapshotKind::Full),
                (Some(path), Some(Ok(kind))) => self.snapshot(control, Path::new(path), kind),
                (Some(_), Some(Err(e))) => Err(e.to_string()),
                (None, _) => Err("snapshot needs \"path\": the file to write".into()),
            },
            Some("migrate") => match field("to") {
                Some(to) => return self.migrate(control, to),
                None => Err("migrate needs \"to\": unix:<path> or tcp:<ip>:<port>".into()),
            },
            Some(other) => Err(format!("unknown command {other:?}: {COMMANDS}")),
            None => Err(format!("no \"command\": {COMMANDS}")),
        };
        (answer.unwrap_or_else(failure), Next::Serve)
    }

    fn state(&self) -> &'static str {
        match self.paused {
            Some(_) => "paused",
            None => "running",
        }
    }

    fn status(&self, control: &RunControl) -> Value {
        let d = control.description();
        json!({
            "ok": true,
            "state": self.state(),
            "guest": d.program,
            "vcpus": d.vcpus,
            "mem_mib": d.mem_mib,
            "irqchip": d.irqchip.to_string(),
            "uptime_ms": millis(self.started.elapsed()),
        })
    }

    fn pause(&mut self, control: &RunControl) -> Result<Value, String> {
        if self.paused.is_some() {
            return Err("the guest is paused already".into());
        }
        let start = Instant::now();
        let states = control.pause(PAUSE_TIMEOUT).map_err(|e| e.to_string())?;
        self.paused = Some(states);
        Ok(json!({ "ok": true, "state": "paused", "took_ms": millis(start.elapsed()) }))
    }

    fn resume(&mut self, control: &RunControl) -> Result<Value, String> {
        match self.paused.take() {
            Some(_) => {
                control.resume();
                Ok(json!({ "ok": true, "state": "running" }))
            }
            None => Err("the guest is not paused".into()),
        }
    }

    /// A snapshot of a paused guest leaves it paused; of a running one,
    /// pauses it for the write and runs it on before the file's sync.
    fn snapshot(
        &mut self,
        control: &RunControl,
        path: &Path,
        kind: SnapshotKind,
    ) -> Result<Value, String> {
        let written = match self.paused.as_deref() {
            Some(states) => self.mover.snapshot_paused(control, states, path, kind),
            None => self.mover.snapshot(control, path, kind),
        };
        let report = written.map_err(|e| e.to_string())?;
        let mut answer = report_json(&report);
        answer["state"] = self.state().into();
        Ok(answer)
    }

    /// Migrates the running guest; on success it runs at the destination
    /// and this run ends.
    fn migrate(&mut self, control: &RunControl, to: &str) -> (Value, Next) {
        if self.paused.is_some() {
            let error = "the guest is paused: resume it first (pre-copy runs beside it)";
            return (failure(error.into()), Next::Serve);
        }
        let target = match (self.targets)(to) {
            Ok(target) => target,
            Err(e) => return (failure(e), Next::Serve),
        };
        match self.mover.migrate(control, &target) {
            Ok(report) => (report_json(&report), Next::Done),
            Err(e @ MigrationError::Unconfirmed(_)) => (failure(e.to_string()), Next::Done),
            Err(e) => {
                let mut answer = failure(format!("{e}; the guest runs on here"));
                answer["state"] = "running".into();
                (answer, Next::Serve)
            }
        }
    }
}

/// A client's side: sends `command` to the socket at `path` and reads its
/// answer, waiting at most `timeout` for it.
pub fn request(path: &Path, command: &Value, timeout: Duration) -> io::Result<Value> {
    let mut stream = UnixStream::connect(path)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    stream.write_all(format!("{command}\n").as_bytes())?;
    let mut answer = Vec::new();
    BufReader::new(stream.take(MAX_LINE as u64)).read_until(b'\n', &mut answer)?;
    serde_json::from_slice(&answer).map_err(|e| match answer.is_empty() {
        true => io::Error::new(io::ErrorKind::UnexpectedEof, "no answer came"),
        false => io::Error::new(io::ErrorKind::InvalidData, format!("the answer: {e}")),
    })
}

fn stats(control: &RunControl) -> Value {
    let s = control.stats();
    json!({
        "ok": true,
        "interrupts": s.interrupts,
        "kicks": s.kicks,
        "wakes": s.wakes,
        "boosts": s.boosts,
        "polled_ns": s.polled_ns,
        "blocked_ns": s.blocked_ns,
        "attempted_polls": s.attempted_polls,
        "successful_polls": s.successful_polls,
        "timer_expiries": s.timer_expiries,
    })
}

fn report_json(r: &MigrationReport) -> Value {
    json!({
        "ok": true,
        "snapshot": r.snapshot,
        "rounds": r.rounds,
        "converged": r.converged,
        "pages_sent": r.pages_sent,
        "final_pages": r.final_pages,
        "halted_vcpus": r.halted,
        "total_ms": millis(r.total),
        "downtime_ms": millis(r.downtime),
    })
}

fn failure(error: String) -> Value {
    json!({ "ok": false, "error": error })
}

fn millis(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
    )
}

fn reply(out: &mut UnixStream, answer: &Value) -> io::Result<()> {
    out.write_all(format!("{answer}\n").as_bytes())
}
