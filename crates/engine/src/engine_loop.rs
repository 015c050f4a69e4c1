//! The engine loop, written once: take commands (sleeping on the channel when there is nothing to
//! do), run an iteration's work, and stop after a shutdown's grace period or when every handle is
//! gone. `Engine::run` (one engine), a data-parallel replica (`dp::group`) and a lockstep rank
//! (`dp::lockstep`, whose iteration is an agreement with its peers and then its share of the
//! agreed step) run it with their own [`LoopHook`].

use crate::api::RequestEvent;
use crate::engine::Engine;
use crate::fault::{FaultInjection, FaultPhase};
use crate::handle::EngineCommand;
use crate::step::StepStats;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::time::{Duration, Instant};

/// Whether an iteration first waits for a command.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Wait {
    /// Take what is there and go on.
    No,
    /// Sleep until a command comes or this much time passed.
    Until(Duration),
    /// Sleep until a command comes (or every handle is gone).
    Forever,
}

/// Whether the loop goes on after an iteration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Flow {
    Continue,
    Stop,
}

/// What a loop adds around the engine's own work. Every method has the plain engine's behaviour
/// as its default.
pub(crate) trait LoopHook {
    /// Once, before the first command.
    fn on_start(&mut self, _engine: &mut Engine) {}

    /// Whether this iteration waits for a command first: while the engine has nothing to do.
    fn wait(&self, engine: &Engine, commands: &Commands) -> Wait {
        if engine.has_work() || commands.is_stopping() {
            Wait::No
        } else {
            Wait::Forever
        }
    }

    /// Before sleeping on the channel.
    fn on_idle(&mut self, _engine: &mut Engine) {}

    /// One iteration's work, once the commands that came were applied: a step while there is
    /// work; stop once a shutdown (or the last handle gone) left none, or the grace period ended.
    fn iterate(&mut self, engine: &mut Engine, commands: &mut Commands) -> Flow {
        if commands.is_stopping() {
            if !engine.has_work() {
                return Flow::Stop;
            }
            if commands.grace_over() {
                engine.fail_all("the server is shutting down and the grace period for in-flight requests ended");
                return Flow::Stop;
            }
        }
        if engine.has_work() {
            commands.steps += 1;
            if let Err(message) = FaultInjection::trip(engine.config().fault_injection, commands.steps, FaultPhase::EngineLoop) {
                // the test switch kills the thread whatever its kind
                panic!("{message}");
            }
            let stats = engine.step();
            self.after_step(engine, &stats);
        }
        Flow::Continue
    }

    /// After each step of the default `iterate`.
    fn after_step(&mut self, _engine: &mut Engine, _stats: &StepStats) {}

    /// Once, after the loop ended, what the pipeline held was settled and commands that came
    /// after the last iteration were refused.
    fn on_stop(&mut self, _engine: &mut Engine) {}
}

/// One loop's command handling and shutdown state.
#[derive(Debug, Default)]
pub(crate) struct Commands {
    /// When in-flight requests must be done; set by the first shutdown (own or agreed).
    pub shutdown_at: Option<Instant>,
    /// Every handle is gone: no command can come any more.
    pub channel_closed: bool,
    /// Steps the default `LoopHook::iterate` ran (the engine-loop fault switch counts them).
    pub steps: u64,
}

impl Commands {
    pub fn begin_shutdown(&mut self, grace: Duration) {
        if self.shutdown_at.is_none() {
            self.shutdown_at = Some(Instant::now() + grace);
        }
    }

    /// A shutdown began or no handle is left: the loop ends once its work is done.
    pub fn is_stopping(&self) -> bool {
        self.shutdown_at.is_some() || self.channel_closed
    }

    /// Waits as `wait` says, then applies every command there is to `engine`.
    pub fn receive(&mut self, engine: &mut Engine, rx: &Receiver<EngineCommand>, wait: Wait) {
        if !self.channel_closed {
            let first = match wait {
                Wait::No => None,
                Wait::Forever => Some(rx.recv().map_err(|_| RecvTimeoutError::Disconnected)),
                Wait::Until(d) => Some(rx.recv_timeout(d)),
            };
            match first {
                Some(Ok(cmd)) => self.apply(engine, cmd),
                Some(Err(RecvTimeoutError::Disconnected)) => self.channel_closed = true,
                Some(Err(RecvTimeoutError::Timeout)) | None => {}
            }
        }
        while !self.channel_closed {
            match rx.try_recv() {
                Ok(cmd) => self.apply(engine, cmd),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => self.channel_closed = true,
            }
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
            let wait = hook.wait(&self, &commands);
            if wait != Wait::No {
                hook.on_idle(&mut self);
            }
            commands.receive(&mut self, &rx, wait);
            if hook.iterate(&mut self, &mut commands) == Flow::Stop {
                break;
            }
        }
        self.discard_in_flight();
        // what came after the last iteration is refused, not dropped
        commands.begin_shutdown(Duration::ZERO);
        commands.receive(&mut self, &rx, Wait::No);
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
        // before going idle, or the gauges would show the last step's numbers forever (after the
        // idle work: the prefix cache's last saves change its tiers' gauges).
        engine.idle();
        engine.flush_metrics();
    }

    fn on_stop(&mut self, _engine: &mut Engine) {
        tracing::info!("engine stopped");
    }
}
