//! MLX's distributed layer through the bindings: a group of one without a
//! launcher, and two ranks over the `ring` backend on loopback (this test
//! binary started twice with the environment `mlx.launch` sets:
//! `MLX_RANK` and `MLX_HOSTFILE`), including a peer that dies.

use std::process::Command;

use mlxcel_mlx::{distributed, Array};

const CHILD: &str = "MLXCEL_DIST_TEST_CHILD";

/// A free loopback port (bound and released; the race is harmless here).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Runs test `name` of this binary as ranks 0 and 1 of a ring, waits for
/// both, returns their exit statuses and outputs.
fn run_two_ranks(name: &str) -> Vec<(i32, String)> {
    let dir = std::env::temp_dir().join(format!("mlxcel-dist-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let hostfile = dir.join("hosts.json");
    let hosts = format!(
        r#"[["127.0.0.1:{}"],["127.0.0.1:{}"]]"#,
        free_port(),
        free_port()
    );
    std::fs::write(&hostfile, hosts).unwrap();
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..2)
        .map(|rank| {
            Command::new(&exe)
                .args([name, "--exact", "--nocapture", "--test-threads=1"])
                .env(CHILD, "1")
                .env("MLX_RANK", rank.to_string())
                .env("MLX_HOSTFILE", &hostfile)
                .output_async()
        })
        .collect();
    children.into_iter().map(|c| c.finish()).collect()
}

/// `Command::output` started now, collected later.
trait OutputAsync {
    fn output_async(&mut self) -> Pending;
}

struct Pending(std::process::Child);

impl OutputAsync for Command {
    fn output_async(&mut self) -> Pending {
        Pending(
            self.stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap(),
        )
    }
}

impl Pending {
    fn finish(self) -> (i32, String) {
        let out = self.0.wait_with_output().unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.code().unwrap_or(-1), text)
    }
}

fn is_child() -> bool {
    std::env::var_os(CHILD).is_some()
}

#[test]
fn without_a_launcher_the_group_is_one_process() {
    if is_child() {
        return;
    }
    assert!(distributed::is_available("ring").unwrap());
    // Strict init of a backend with no hostfile is an error, not an abort.
    assert!(distributed::init("ring", true).is_err());
    assert!(distributed::world().is_none());
    let g = distributed::init("any", false).unwrap();
    assert_eq!((g.rank(), g.size()), (0, 1));
    let x = Array::from_f32(&[1.0, 2.0, 3.0], &[3]).unwrap();
    let sum = distributed::all_sum(&x, None).unwrap();
    assert_eq!(sum.to_vec_f32().unwrap(), vec![1.0, 2.0, 3.0]);
    let gathered = distributed::all_gather(&x, Some(g)).unwrap();
    assert_eq!(gathered.to_vec_f32().unwrap(), vec![1.0, 2.0, 3.0]);
}

#[test]
fn two_ranks_sum_gather_send_and_receive() {
    if !is_child() {
        let results = run_two_ranks("two_ranks_sum_gather_send_and_receive");
        for (rank, (code, out)) in results.iter().enumerate() {
            assert_eq!(*code, 0, "rank {rank} failed:\n{out}");
            assert!(out.contains("collectives ok"), "rank {rank}:\n{out}");
        }
        return;
    }
    let g = distributed::init("ring", true).unwrap();
    assert_eq!(g.size(), 2);
    let r = g.rank() as f32;
    let x = Array::from_f32(&[r + 1.0, 10.0 * (r + 1.0)], &[2]).unwrap();
    let sum = distributed::all_sum(&x, None)
        .unwrap()
        .to_vec_f32()
        .unwrap();
    assert_eq!(sum, vec![3.0, 30.0]);
    let all = distributed::all_gather(&x, None)
        .unwrap()
        .to_vec_f32()
        .unwrap();
    assert_eq!(all, vec![1.0, 10.0, 2.0, 20.0]);
    let ids = Array::from_i32(&[7, 8, 9], &[3]).unwrap();
    if g.rank() == 0 {
        distributed::send(&ids, 1, None).unwrap().eval().unwrap();
    } else {
        let got = distributed::recv_like(&ids, 0, None).unwrap();
        assert_eq!(got.to_vec_i32().unwrap(), vec![7, 8, 9]);
    }
    println!("collectives ok");
}

#[test]
fn a_peer_that_exits_makes_the_collective_an_error() {
    if !is_child() {
        let results = run_two_ranks("a_peer_that_exits_makes_the_collective_an_error");
        let (code, out) = &results[0];
        assert_eq!(*code, 0, "rank 0:\n{out}");
        assert!(out.contains("collective failed: mlx:"), "rank 0:\n{out}");
        return;
    }
    let g = distributed::init("ring", true).unwrap();
    let x = Array::from_f32(&[1.0; 64], &[64]).unwrap();
    distributed::all_sum(&x, None).unwrap().eval().unwrap();
    if g.rank() == 1 {
        // Gone without a word, as a crashed rank.
        std::process::exit(0);
    }
    let mut failed = None;
    for _ in 0..1000 {
        if let Err(e) = distributed::all_sum(&x, None).and_then(|s| s.eval()) {
            failed = Some(e);
            break;
        }
    }
    let e = failed.expect("collectives with a dead peer kept succeeding");
    println!("collective failed: {e}");
}
