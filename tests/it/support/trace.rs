//! A reproducible synthetic request trace for the accuracy study: many
//! clients, Poisson and bursty senders, weighted costs.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// One request: when (µs), from which client, at what cost.
#[derive(Debug, Clone, Copy)]
pub struct Request {
    pub at: u64,
    pub client: u32,
    pub cost: u32,
}

/// How a client sends.
#[derive(Debug, Clone, Copy)]
pub enum Sender {
    /// Poisson arrivals at `per_second`.
    Poisson { per_second: f64 },
    /// Bursts of `min..=max` requests at `rate` per second, separated by
    /// exponential pauses averaging `pause_s` seconds.
    Bursty {
        min: u32,
        max: u32,
        rate: f64,
        pause_s: f64,
    },
}

/// A population's share of each kind of sender.
#[derive(Debug, Clone, Copy)]
pub enum Class {
    /// Poisson at 1–50% of the limit (log-uniform): most clients.
    Light,
    /// Poisson at 50–150% of the limit.
    Heavy,
    /// Bursts of 10–150 requests at 20–100 per second, a minute apart on
    /// average.
    Bursty,
    /// Poisson at 3–10× the limit.
    Abusive,
}

/// The study's population, for a policy of `limit` units a minute and
/// requests costing 1.7 units on average: 1,080 light, 80 heavy, 32
/// bursty and 8 abusive clients.
pub fn mix(limit: f64, rng: &mut ChaCha8Rng) -> Vec<(Class, Sender)> {
    let per_second = |units_per_minute: f64| units_per_minute / 60.0 / MEAN_COST;
    let mut senders = Vec::new();
    for _ in 0..1080 {
        let share = (rng.gen_range(0.01f64.ln()..0.5f64.ln())).exp();
        let sender = Sender::Poisson {
            per_second: per_second(share * limit),
        };
        senders.push((Class::Light, sender));
    }
    for _ in 0..80 {
        let share = rng.gen_range(0.5..1.5);
        let sender = Sender::Poisson {
            per_second: per_second(share * limit),
        };
        senders.push((Class::Heavy, sender));
    }
    for _ in 0..32 {
        let sender = Sender::Bursty {
            min: 10,
            max: 150,
            rate: rng.gen_range(20.0..100.0),
            pause_s: 60.0,
        };
        senders.push((Class::Bursty, sender));
    }
    for _ in 0..8 {
        let share = rng.gen_range(3.0..10.0);
        let sender = Sender::Poisson {
            per_second: per_second(share * limit),
        };
        senders.push((Class::Abusive, sender));
    }
    senders
}

const MEAN_COST: f64 = 1.7;

/// 1 (70%), 2 (20%) or 5 (10%) units: 1.7 on average.
fn cost(rng: &mut ChaCha8Rng) -> u32 {
    match rng.gen_range(0..10) {
        0..=6 => 1,
        7 | 8 => 2,
        _ => 5,
    }
}

fn exponential(rng: &mut ChaCha8Rng, mean_s: f64) -> u64 {
    let u: f64 = rng.gen_range(f64::EPSILON..1.0);
    (-u.ln() * mean_s * 1e6) as u64
}

/// The study's clients' requests over `duration_s` seconds from `start`
/// (µs), in time order, from `seed`; and each client's class.
pub fn trace(seed: u64, limit: u32, start: u64, duration_s: u64) -> (Vec<Request>, Vec<Class>) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let end = start + duration_s * 1_000_000;
    let mut requests = Vec::new();
    let population = mix(f64::from(limit), &mut rng);
    let classes = population.iter().map(|(class, _)| *class).collect();
    for (client, (_, sender)) in population.into_iter().enumerate() {
        let client = client as u32;
        let mut at = start + rng.gen_range(0..60_000_000);
        match sender {
            Sender::Poisson { per_second } => loop {
                at += exponential(&mut rng, 1.0 / per_second);
                if at >= end {
                    break;
                }
                requests.push(Request {
                    at,
                    client,
                    cost: cost(&mut rng),
                });
            },
            Sender::Bursty {
                min,
                max,
                rate,
                pause_s,
            } => 'bursts: loop {
                at += exponential(&mut rng, pause_s);
                for _ in 0..rng.gen_range(min..=max) {
                    at += exponential(&mut rng, 1.0 / rate);
                    if at >= end {
                        break 'bursts;
                    }
                    requests.push(Request {
                        at,
                        client,
                        cost: cost(&mut rng),
                    });
                }
            },
        }
    }
    requests.sort_by_key(|r| (r.at, r.client));
    (requests, classes)
}
