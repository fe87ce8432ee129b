//! A charge that fits is never refused because of a concurrent charge that
//! does not: a refused charge must not change `used`, not even for a moment.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use vzram_store::limits::Budget;

#[test]
fn charges_that_fit_are_never_refused() {
    const LIMIT: u64 = 1 << 20;
    const FITTERS: u64 = 2;
    const HAMMERS: usize = 2;
    // Every fitter holding its charge at once is still exactly the limit.
    const FIT: u64 = LIMIT / FITTERS;
    const ROUNDS: u64 = 200_000;
    // A fitter keeps going until it has seen the hammers make progress
    // between two of its own charges this often: proof that the two really
    // ran at the same time, which a loaded 2-core machine does not promise.
    const OVERLAPS: u64 = 100_000;

    let budget = Budget::new(LIMIT);
    let done = AtomicBool::new(false);
    let hammer_tries = AtomicU64::new(0);
    let hammer_accepted = AtomicU64::new(0);
    let start = Barrier::new(FITTERS as usize + HAMMERS);
    let deadline = Instant::now() + Duration::from_secs(2);

    let (refused, overlaps) = std::thread::scope(|s| {
        for i in 0..HAMMERS {
            let (budget, done, start) = (&budget, &done, &start);
            let (tries, accepted) = (&hammer_tries, &hammer_accepted);
            s.spawn(move || {
                // Never fits, whatever else is charged.
                let big = LIMIT + 1 + i as u64;
                start.wait();
                while !done.load(Relaxed) {
                    if budget.try_charge(big) {
                        accepted.fetch_add(1, Relaxed);
                        budget.uncharge(big);
                    }
                    tries.fetch_add(1, Relaxed);
                }
            });
        }
        let fitters: Vec<_> = (0..FITTERS)
            .map(|_| {
                let (budget, start, tries) = (&budget, &start, &hammer_tries);
                s.spawn(move || {
                    start.wait();
                    let (mut refused, mut overlaps, mut rounds) = (0u64, 0u64, 0u64);
                    let mut seen = tries.load(Relaxed);
                    while rounds < ROUNDS
                        || (overlaps < OVERLAPS
                            && (rounds % 1024 != 0 || Instant::now() < deadline))
                    {
                        if budget.try_charge(FIT) {
                            budget.uncharge(FIT);
                        } else {
                            refused += 1;
                        }
                        rounds += 1;
                        let now = tries.load(Relaxed);
                        overlaps += u64::from(now != seen);
                        seen = now;
                    }
                    (refused, overlaps)
                })
            })
            .collect();
        let res = fitters
            .into_iter()
            .map(|t| t.join().unwrap())
            .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
        done.store(true, Relaxed);
        res
    });

    eprintln!("{overlaps} fitter charges overlapped the hammers");
    assert_eq!(
        refused, 0,
        "{refused} charges that fit were refused ({overlaps} overlapped the hammers)"
    );
    assert_eq!(
        hammer_accepted.load(Relaxed),
        0,
        "a charge over the limit was accepted"
    );
    assert_eq!(budget.used(), 0);
    assert!(
        budget.max() <= LIMIT,
        "max {} passed the limit",
        budget.max()
    );
    assert!(
        budget.max() >= FIT,
        "max {} missed every charge",
        budget.max()
    );
}

/// `max` records only values `used` really held.
#[test]
fn refused_charges_leave_used_and_max_alone() {
    let b = Budget::new(100);
    assert!(b.try_charge(70));
    assert!(!b.try_charge(31));
    assert!(!b.try_charge(u64::MAX));
    assert_eq!((b.used(), b.max()), (70, 70));
    assert!(b.try_charge(30));
    assert_eq!((b.used(), b.max()), (100, 100));
    b.uncharge(100);
    b.reset_max();
    assert_eq!((b.used(), b.max()), (0, 0));
}
