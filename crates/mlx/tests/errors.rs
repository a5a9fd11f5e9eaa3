//! MLX exceptions become `Err`, and the process (and MLX) keep working.

use mlxcel_mlx::Array;

#[test]
fn shape_mismatch_is_an_error_not_an_abort() {
    let a = Array::from_f32(&[1., 2., 3.], &[3]).unwrap();
    let b = Array::from_f32(&[1., 2.], &[2]).unwrap();
    let err = a.add(&b).unwrap_err();
    assert!(err.0.contains("broadcast"), "message was {err}");
    let err = a.matmul(&b).unwrap_err();
    assert!(!err.0.is_empty());
    // MLX still works afterwards.
    assert_eq!(a.add(&a).unwrap().to_vec_f32().unwrap(), vec![2., 4., 6.]);
}

#[test]
fn bad_input_lengths_are_errors() {
    assert!(Array::from_f32(&[1., 2.], &[3]).is_err());
    assert!(Array::from_f32(&[1., 2.], &[-2]).is_err());
    let a = Array::from_f32(&[1., 2.], &[2]).unwrap();
    assert!(a.reshape(&[3]).is_err());
    assert!(a.dim(5).is_err());
    assert!(
        mlxcel_mlx::SafeTensors::load(std::path::Path::new("/nonexistent.safetensors")).is_err()
    );
}

#[test]
fn failure_inside_eval_is_an_error() {
    // Building the graph succeeds; LAPACK's LU fails only when evaluated.
    let singular = Array::from_f32(&[1., 2., 2., 4.], &[2, 2]).unwrap();
    let inv = singular.linalg_inv().unwrap();
    let err = inv.eval().unwrap_err();
    assert!(err.0.contains("LU factorization failed"), "{err}");
    // A fresh failing graph with a consumer fails the same way through a read.
    let consumer = singular
        .linalg_inv()
        .unwrap()
        .add(&Array::scalar(1.0).unwrap())
        .unwrap();
    let err = consumer.to_vec_f32().unwrap_err();
    assert!(err.0.contains("factorization"), "{err}");
    // The next evaluation on the same thread works, and so does a good inverse.
    let good = Array::from_f32(&[2., 0., 0., 4.], &[2, 2])
        .unwrap()
        .linalg_inv()
        .unwrap();
    assert_eq!(good.to_vec_f32().unwrap(), vec![0.5, 0., 0., 0.25]);
}
