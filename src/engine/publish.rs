//! What the engine shows the readers beside it: snapshots for exporters
//! (at most every [`PUBLISH_EVERY`]), pressure notices for socket
//! subscribers, and the socket server's counters copied into the run's.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Engine;
use crate::event::protocol::Notice;
use crate::store::Applied;

/// Snapshots for exporters are published at most this often.
const PUBLISH_EVERY: Duration = Duration::from_millis(100);

/// The leak verdicts a snapshot carries are judged again at most this
/// often (a verdict costs milliseconds; the rule needs 20 s of samples).
const LEAK_EVERY: Duration = Duration::from_secs(5);

impl Engine {
    /// Publishes a snapshot for exporters, at most every 100 ms unless
    /// `force`d.
    pub(super) fn publish(&mut self, now: Instant, force: bool) {
        let Some(tx) = &self.outputs.snapshots else {
            return;
        };
        // Nobody reads snapshots (HTTP off): do not build them.
        if tx.receiver_count() == 0
            || !force && now.duration_since(self.last_publish) < PUBLISH_EVERY
        {
            return;
        }
        self.last_publish = now;
        let mut snap = self.store.snapshot();
        let stale = self
            .leak
            .as_ref()
            .is_none_or(|(at, _)| force || now.duration_since(*at) >= LEAK_EVERY);
        if stale {
            self.leak = Some((now, self.store.leak_report()));
        }
        snap.leak = self.leak.as_ref().map(|(_, l)| l.clone());
        snap.tick_seconds = self.tick_seconds.clone();
        for (name, counter) in &self.outputs.export_errors {
            snap.export_errors
                .insert(name.clone(), counter.load(Ordering::Relaxed));
        }
        tx.send_replace(Arc::new(snap));
    }

    /// Logs the pressure levels a record crossed and tells subscribers.
    pub(super) fn announce(&self, outcome: &Applied) {
        for alert in &outcome.alerts {
            tracing::warn!(resource = %alert.resource, level = %alert.level, "{}", alert.message);
            if let Some(link) = &self.events {
                let _ = link.notices.send(Notice::Pressure {
                    resource: alert.resource.clone(),
                    level: alert.level.clone(),
                    previous: alert.previous.clone(),
                    used_ratio: alert.used_ratio,
                    timestamp: alert.timestamp,
                    message: alert.message.clone(),
                    seconds_to_limit: None,
                });
            }
        }
        // Time to OOM: a notice before the limit, level `forecast`.
        for f in &outcome.forecasts {
            tracing::warn!(resource = %f.resource, "{}", f.message);
            if let Some(link) = &self.events {
                let level = self
                    .store
                    .all_levels()
                    .get(&f.resource)
                    .copied()
                    .unwrap_or_default();
                let _ = link.notices.send(Notice::Pressure {
                    resource: f.resource.clone(),
                    level: "forecast".into(),
                    previous: level.as_str().into(),
                    used_ratio: if f.limit_mb > 0.0 {
                        f.used_mb / f.limit_mb
                    } else {
                        0.0
                    },
                    timestamp: self.store.current().timestamp,
                    message: f.message.clone(),
                    seconds_to_limit: Some(f.seconds),
                });
            }
        }
    }

    /// Copies the socket server's counters into the run's.
    pub(super) fn sync_counters(&mut self) {
        if let Some(link) = &self.events {
            let c = self.store.counters_mut();
            c.protocol_errors = link.stats.protocol_errors.load(Ordering::Relaxed);
            c.dropped_events = link.stats.dropped.load(Ordering::Relaxed);
            c.refused_peers = link.stats.refused.load(Ordering::Relaxed);
            c.rejected_connections = link.stats.rejected_connections.load(Ordering::Relaxed);
            c.slow_clients = link.stats.slow_clients.load(Ordering::Relaxed);
        }
    }
}
