//! The engine loop, written once: take commands, step while there is work, sleep on the channel
//! when there is none, and stop after a shutdown's grace period or when every handle is gone.
//! `Engine::run` (one engine) and a data-parallel replica (`dp::group`) run it with their own
//! [`LoopHook`]; a lockstep rank (`dp::lockstep`), whose steps are agreed with its peers, shares
//! its command handling ([`Commands`]).

use crate::api::RequestEvent;
use crate::engine::Engine;
use crate::handle::EngineCommand;
use crate::step::StepStats;
use std::sync::atomic::Ordering;
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

/// What a loop adds around the engine's own work. Every method defaults to nothing.
pub(crate) trait LoopHook {
    /// Once, before the first command.
    fn on_start(&mut self, _engine: &mut Engine) {}
    /// Before sleeping on the channel with no work.
    fn on_idle(&mut self, _engine: &mut Engine) {}
    /// After each step.
    fn after_step(&mut self, _engine: &mut Engine, _stats: &StepStats) {}
    /// Once, after the loop ended and what the pipeline held was settled.
    fn on_stop(&mut self, _engine: &mut Engine) {}
}

/// Shutdown state of one loop's command handling.
#[derive(Debug, Default)]
pub(crate) struct Commands {
    /// When in-flight requests must be done; set by the first shutdown (own or agreed).
    pub shutdown_at: Option<Instant>,
}

impl Commands {
    pub fn begin_shutdown(&mut self, grace: Duration) {
        if self.shutdown_at.is_none() {
            self.shutdown_at = Some(Instant::now() + grace);
        }
    }

    /// Applies one command to `engine`: a submit during shutdown is refused at once.
    pub fn apply(&mut self, engine: &mut Engine, cmd: EngineCommand) {
        match cmd {
            EngineCommand::Submit(req) => {
                if self.shutdown_at.is_some() {
                    engine.refuse(req, "the server is shutting down");
                } else {
                    engine.add_request(req);
                }
            }
            EngineCommand::Abort(id) => engine.abort(id),
            EngineCommand::Shutdown => self.begin_shutdown(engine.config().shutdown_grace),
        }
    }

    /// Whether the grace period has run out.
    pub fn grace_over(&self) -> bool {
        self.shutdown_at.is_some_and(|d| Instant::now() >= d)
    }
}

impl Engine {
    /// Runs until the command channel closes or a shutdown's grace period ends.
    pub fn run(self, rx: Receiver<EngineCommand>) {
        self.run_with(rx, &mut Standalone);
    }

    /// The engine loop with `hook` around it (see the module docs).
    pub(crate) fn run_with<H: LoopHook>(mut self, rx: Receiver<EngineCommand>, hook: &mut H) {
        let mut commands = Commands::default();
        hook.on_start(&mut self);
        loop {
            if !self.has_work() && commands.shutdown_at.is_none() {
                hook.on_idle(&mut self);
                match rx.recv() {
                    Ok(cmd) => commands.apply(&mut self, cmd),
                    Err(_) => break,
                }
            }
            while let Ok(cmd) = rx.try_recv() {
                commands.apply(&mut self, cmd);
            }
            if commands.shutdown_at.is_some() {
                if !self.has_work() {
                    break;
                }
                if commands.grace_over() {
                    self.fail_all("the server is shutting down and the grace period for in-flight requests ended");
                    break;
                }
            }
            if self.has_work() {
                let stats = self.step();
                hook.after_step(&mut self, &stats);
            }
        }
        self.discard_in_flight();
        hook.on_stop(&mut self);
    }

    /// Refuses a submitted request without accepting it (it was counted as waiting by the handle).
    pub(crate) fn refuse(&mut self, req: crate::api::GenerateRequest, message: &str) {
        self.host().counters.waiting.fetch_sub(1, Ordering::Relaxed);
        let _ = req.events.send(RequestEvent::Failed { message: message.into() });
    }
}

/// `Engine::run`'s hook: the unlabeled engine gauges, published when going idle.
struct Standalone;

impl LoopHook for Standalone {
    fn on_start(&mut self, engine: &mut Engine) {
        // Engine metrics exist from the start (a counter such as num_preemptions_total would
        // otherwise be missing from /metrics until its first increment).
        metrics::counter!("specula:num_preemptions_total").increment(0);
        engine.flush_metrics();
    }

    fn on_idle(&mut self, engine: &mut Engine) {
        // Aborts and refused submits change the pool and queues without a step; publish that
        // before going idle, or the gauges would show the last step's numbers forever.
        engine.flush_metrics();
        engine.idle();
    }

    fn on_stop(&mut self, _engine: &mut Engine) {
        tracing::info!("engine stopped");
    }
}
